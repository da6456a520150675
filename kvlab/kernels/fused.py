"""Which kernels a device runs: the fused Triton decode kernels where they run, the torch reference elsewhere."""

from __future__ import annotations

from types import ModuleType

import torch


def fused_kernels(device: torch.device) -> ModuleType | None:
    """``kvlab.kernels.triton`` where its decode kernels run on ``device`` (CUDA, with ``kvlab[gpu]`` installed),
    else ``None``. Only CUDA: on the CPU the torch kernels are the reference, and stay the path taken."""
    if device.type != "cuda":
        return None
    try:
        from kvlab.kernels import triton as fused
    except ImportError:
        return None
    return fused if fused.available(device) else None
