"""Which device to run on, and how to wait for it: the two things every timing needs."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """CUDA when present, else CPU. (Apple's MPS is left to an explicit ``device="mps"``.)"""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    return default_device() if device is None else torch.device(device)


def synchronize(device: torch.device) -> None:
    """Block until queued GPU work is done, so a host clock measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
