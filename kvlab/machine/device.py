"""Which device to run on, how to wait for it, and how large the CPU's last-level cache is: what every timing needs."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

SYSFS_CPU = Path("/sys/devices/system/cpu")


def default_device() -> torch.device:
    """CUDA when present, else CPU. (Apple's MPS is left to an explicit ``device="mps"``.)"""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None, name: str = "device") -> torch.device:
    """The torch device ``device`` names (None: ``default_device()``). A name torch does not know, or a GPU this
    machine lacks, raises ``ValueError`` naming ``name`` and the devices there are: torch's own error for a missing
    GPU is a bare ``AssertionError`` at the first tensor, far from the argument that caused it."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name}: {device!r} is not a device; allowed: {_devices_here()}") from None
    index = resolved.index or 0
    absent = (resolved.type == "cuda" and index >= torch.cuda.device_count()) or (
        resolved.type == "mps" and (index > 0 or not torch.backends.mps.is_available())
    )
    if absent:
        raise ValueError(
            f"{name}: {device!r}, but torch {torch.__version__} finds no such device here; allowed: {_devices_here()}"
        )
    return resolved


def _devices_here() -> str:
    names = ["'cpu'"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names.append("'cuda'" + (f" ('cuda:0' to 'cuda:{n - 1}')" if n > 1 else ""))
    if torch.backends.mps.is_available():
        names.append("'mps'")
    return ", ".join(names)


def synchronize(device: torch.device) -> None:
    """Block until queued GPU work is done, so a host clock measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def last_level_cache_bytes(sysfs_root: str | Path = SYSFS_CPU) -> int | None:
    """Bytes of the CPU's last-level cache, all instances together (one per socket or core complex), or None.

    Read from Linux sysfs (``cpu*/cache/index*/{level,type,size,shared_cpu_list}``) or, on macOS, from
    ``sysctl``. Never raises: a machine that hides its caches gets None, and the caller picks a floor.
    """
    found = _sysfs_llc_bytes(Path(sysfs_root))
    if found is None and platform.system() == "Darwin":
        found = _sysctl_llc_bytes()
    return found


def _sysfs_llc_bytes(root: Path) -> int | None:
    # (level, CPUs sharing it) -> bytes: each CPU lists the L3 it shares, and it must be counted once. Without a
    # shared_cpu_list, count one instance per level: summing over CPUs would multiply a shared cache by their count.
    instances: dict[tuple[int, str], int] = {}
    try:
        for index in root.glob("cpu[0-9]*/cache/index[0-9]*"):
            try:
                if (index / "type").read_text().strip() == "Instruction":
                    continue
                level = int((index / "level").read_text())
                size = _parse_size((index / "size").read_text())
                shared_file = index / "shared_cpu_list"
                shared = shared_file.read_text().strip() if shared_file.exists() else ""
            except (OSError, ValueError):
                continue
            instances[(level, shared)] = size
    except OSError:
        return None
    if not instances:
        return None
    top = max(level for level, _ in instances)
    return sum(size for (level, _), size in instances.items() if level == top) or None


def _parse_size(text: str) -> int:
    """sysfs cache sizes: ``"32768K"``, ``"4M"``, or plain bytes."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMGB") or "x") * scale


def _sysctl_llc_bytes() -> int | None:
    # Apple silicon has no L3 visible to software; its performance cores' shared L2 is the last level.
    for key in ("hw.l3cachesize", "hw.perflevel0.l2cachesize", "hw.l2cachesize"):
        try:
            out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False)
            size = int(out.stdout.strip())
        except (OSError, ValueError, subprocess.SubprocessError):
            continue
        if size > 0:
            return size
    return None
