"""Capping the instruction set the CPU kernels use, to measure on a newer x86 CPU what an older one would run.

A laptop with AVX2 only (Zen 2 and 3, Intel client CPUs before AVX-512) runs other kernels than a server with
AVX-512, AVX512-BF16 or AMX: for half-precision weights, other kernels altogether (``kvlab.model.weights``). Each
library that picks a kernel by the CPU's instructions also reads a variable that caps what it may use, so one
process with all of them set runs the kernels an AVX2-only CPU would. Only the instructions change; the memory
system, caches and clock stay this machine's, so a capped run shows which kernel runs and how it compares with
the others on the same memory, not an older CPU's absolute times.

The variables are read when each library loads, so a cap applies to a new process (``capped_environ``); what a
process was started under, ``isa_caps_in_effect`` reads back, and ``machine_info`` records it beside every timing.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

import torch

# Each library's own variable, and the value that caps it at AVX2 (with FMA and F16C, which every AVX2 CPU has).
ISA_CAPS: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's own vectorized kernels
        "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN: its bf16/fp16 products, and its native-half probes
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",  # fbgemm: int8 and fp16 products
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL: torch's fp32 BLAS on x86
        "OPENBLAS_CORETYPE": "Haswell",  # numpy's OpenBLAS: the kernels it runs on any AVX2 CPU
    },
}


def capped_environ(isa: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with every library capped at ``isa`` (a key of ``ISA_CAPS``), for a new
    process. Raises ``ValueError`` naming the field on an unknown ``isa``, off x86, or on a CPU without it."""
    if isa not in ISA_CAPS:
        raise ValueError(f"isa: {isa!r}; allowed: {', '.join(ISA_CAPS)}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"isa: {isa!r} caps x86 kernels; this machine is {platform.machine()}: allowed on x86 only")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise ValueError(f"isa: {isa!r}; this CPU lacks it (PyTorch sees {capability})")
    return {**(os.environ if base is None else base), **ISA_CAPS[isa]}


def isa_caps_in_effect(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every cap variable of ``ISA_CAPS`` set in ``environ`` (default this process's), whatever its value: a timing
    taken under any of them ran other kernels than this CPU would pick."""
    environ = os.environ if environ is None else environ
    names = {name for variables in ISA_CAPS.values() for name in variables}
    return {name: environ[name] for name in sorted(names) if name in environ}
