"""The one timer, the one description of the machine, and the ceilings they measure: bandwidth and matmul FLOP/s.

Every timing in kvlab goes through ``Stopwatch`` (timestamps within one run, such as a request's tokens) or
``time_call`` (seconds per call, repeated), so every module waits for the device the same way before it reads a
clock, and every record of a timing carries the same ``machine_info()``.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from kvlab.machine.device import last_level_cache_bytes, resolve_device, synchronize
from kvlab.machine.isa import isa_caps_in_effect
from kvlab.spec.dtypes import to_torch
from kvlab.spec.validation import require_int

K = TypeVar("K", bound=Hashable)

# "thread" counts only this thread's CPU time, so time spent descheduled on a loaded machine does not count.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


# -- the timer ----------------------------------------------------------------------------------------------------
def require_clock(clock: str) -> None:
    """Raise ``ValueError`` naming ``clock`` and the allowed names unless it is one of ``CLOCKS``."""
    if clock not in CLOCKS:
        raise ValueError(f"clock: {clock!r}; allowed: {', '.join(map(repr, CLOCKS))}")


class Stopwatch:
    """Timestamps (seconds since the stopwatch started), each taken once the device has finished queued work.

    On CUDA, events are recorded in stream order and read once at the end, so marking never stalls the GPU; on
    CPU (and MPS), ``clock`` (``CLOCKS``: ``"wall"`` or ``"thread"``) is read after a synchronize.
    """

    def __init__(self, device: str | torch.device | None = None, clock: str = "wall") -> None:
        require_clock(clock)
        self.device = resolve_device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and clock != "wall":
            raise ValueError(f"clock: {clock!r} on {self.device}; allowed: 'wall' (GPU work runs on no host thread)")
        self._now = CLOCKS[clock]
        self._marks: list = []
        synchronize(self.device)
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = self._now()

    def mark(self) -> None:
        """Timestamp the end of all work queued so far."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            synchronize(self.device)
            self._marks.append(self._now() - self._t0)

    def elapsed(self) -> float:
        """Mark, and return the seconds since the start."""
        self.mark()
        return self.times_s()[-1]

    def times_s(self) -> tuple[float, ...]:
        """Every mark, in seconds since the start (waits for the GPU on CUDA)."""
        if self.cuda and self._marks:
            self._marks[-1].synchronize()
            return tuple(self._start.elapsed_time(e) / 1e3 for e in self._marks)
        return tuple(self._marks)


def time_call(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    device: str | torch.device | None = None,
    clock: str = "wall",
) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` calls each timed on its own after ``warmup`` untimed ones.

    Warm-up calls pay for first-touch page faults, allocation and kernel selection, which no steady call does.
    """
    require_int("repeats", repeats)
    require_int("warmup", warmup, 0)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        watch = Stopwatch(device, clock)
        fn()
        times.append(watch.elapsed())
    return times


def time_interleaved(
    fns: Mapping[K, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    device: str | torch.device | None = None,
    clock: str = "wall",
) -> dict[K, list[float]]:
    """Seconds per call of each of ``fns``, taken in turns: each round calls every function once, so that a burst
    of load from elsewhere on the machine slows every function a little rather than one of them a lot. The first
    ``warmup`` rounds are not timed."""
    times: dict[K, list[float]] = {key: [] for key in fns}
    for round_ in range(warmup + repeats):
        for key, fn in fns.items():
            (seconds,) = time_call(fn, 1, warmup=0, device=device, clock=clock)
            if round_ >= warmup:
                times[key].append(seconds)
    return times


# -- the machine --------------------------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """``"AMD"``, ``"Intel"``, or ``"other"``: who made the CPU (``vendor_id`` in /proc/cpuinfo on Linux; the
    processor string on Windows, which names it, e.g. "AMD64 Family 25 Model 1 Stepping 1, AuthenticAMD")."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux, or a sandbox that hides it
        text = platform.processor()
    for tag, vendor in (("AuthenticAMD", "AMD"), ("GenuineIntel", "Intel")):
        if tag in text:
            return vendor
    return "other"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, to print beside a timing taken on a shared machine ("n/a" where the
    system keeps none, as on Windows)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"


def machine_info() -> dict[str, str | int | None]:
    """What a timing depends on, recorded next to it: CPU, cores, torch's threads, versions, the GPU if any, and any
    instruction-set cap the kernels ran under."""
    info: dict[str, str | int | None] = {
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    caps = isa_caps_in_effect()
    if caps:  # the kernels ran under a cap (kvlab.machine.isa), not the ones this CPU picks
        info["isa_caps"] = ", ".join(f"{k}={v}" for k, v in caps.items())
    return info


# -- measured ceilings --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bandwidth:
    """Measured memory bandwidth in GB/s (1e9 bytes/s): median over repeats, and the best repeat.

    ``read_gbps`` is the ceiling a decode step can reach: it reads weights and K/V and writes almost nothing.
    ``copy_gbps`` counts each byte of a copy twice (read and write); it is the figure most tools report.
    ``threads``: torch's CPU threads during the measurement (None when not recorded); a CPU's bandwidth depends
    on it, so a prediction must use a figure measured with the threads the decode runs with.
    """

    device: str
    size_mb: float
    copy_gbps: float
    read_gbps: float
    copy_best_gbps: float
    read_best_gbps: float
    threads: int | None = None


BUFFER_FLOOR_MB = 256  # full-size probe when the cache size is unknown
QUICK_BUFFER_FLOOR_MB = 64


def bandwidth_buffer_mb(quick: bool = False, llc_bytes: int | None = None) -> float:
    """A probe buffer (MB, 1e6 bytes) large enough that the bandwidth measured is memory's, not the cache's.

    Full size: ``max(256, 4 x LLC)``. Quick: ``max(64, 2 x LLC)``, still twice the cache. ``llc_bytes`` defaults to
    what ``kvlab.machine.device.last_level_cache_bytes`` reads; where the machine hides it, the floors apply. A machine
    with 260 MiB of L3 thus gets 1,091 MB (546 quick), where a 64 MB buffer would sit in its cache.
    """
    if llc_bytes is None:
        llc_bytes = last_level_cache_bytes()
    floor, factor = (QUICK_BUFFER_FLOOR_MB, 2) if quick else (BUFFER_FLOOR_MB, 4)
    return float(max(floor, -(-factor * (llc_bytes or 0) // 10**6)))  # whole MB, rounded up


def measure_bandwidth(
    device: str | torch.device | None = None, size_mb: float | None = None, repeats: int = 10
) -> Bandwidth:
    """Copy bandwidth (read + write both counted) and read bandwidth (a sum) over a ``size_mb`` fp32 buffer.

    The buffer must be larger than the last-level cache, or the figure measures the cache, not memory: the
    default, ``bandwidth_buffer_mb()``, sizes it from this machine's cache. On CPU both use torch's current
    thread count, recorded in ``threads``.
    """
    device = resolve_device(device)
    if size_mb is None:
        size_mb = bandwidth_buffer_mb() if device.type == "cpu" else BUFFER_FLOOR_MB
    n = int(size_mb * 1e6 / 4)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy = time_call(lambda: dst.copy_(src), repeats, device=device)
    read = time_call(src.sum, repeats, device=device)
    return Bandwidth(
        device=str(device),
        size_mb=nbytes / 1e6,
        copy_gbps=2 * nbytes / statistics.median(copy) / 1e9,
        read_gbps=nbytes / statistics.median(read) / 1e9,
        copy_best_gbps=2 * nbytes / min(copy) / 1e9,
        read_best_gbps=nbytes / min(read) / 1e9,
        threads=torch.get_num_threads() if device.type == "cpu" else None,
    )


def measure_matmul_flops(
    device: str | torch.device | None = None, n: int = 1024, dtype: str | None = None, repeats: int = 5
) -> float:
    """Dense matmul throughput in FLOP/s for ``n x n`` operands (2 n^3 FLOPs each); bf16 on GPU, fp32 on CPU."""
    device = resolve_device(device)
    torch_dtype = to_torch(dtype or ("bf16" if device.type == "cuda" else "fp32"))
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)
    return 2 * n**3 / statistics.median(time_call(lambda: a @ b, repeats, device=device))
