"""This machine: the device a run uses, a timer that synchronizes before it reads the clock (``Stopwatch``), and the
probes of what the byte model is judged against (read/copy bandwidth, matmul FLOP/s, the machine's description),
and a cap on the instruction set the kernels use, to measure an older CPU's kernels here."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Bandwidth": "kvlab.machine.timing",
    "CLOCKS": "kvlab.machine.timing",
    "ISA_CAPS": "kvlab.machine.isa",
    "Stopwatch": "kvlab.machine.timing",
    "bandwidth_buffer_mb": "kvlab.machine.timing",
    "cpu_name": "kvlab.machine.timing",
    "capped_environ": "kvlab.machine.isa",
    "cpu_vendor": "kvlab.machine.timing",
    "isa_caps_in_effect": "kvlab.machine.isa",
    "last_level_cache_bytes": "kvlab.machine.device",
    "load_average": "kvlab.machine.timing",
    "machine_info": "kvlab.machine.timing",
    "measure_bandwidth": "kvlab.machine.timing",
    "measure_matmul_flops": "kvlab.machine.timing",
    "require_clock": "kvlab.machine.timing",
    "resolve_device": "kvlab.machine.device",
    "synchronize": "kvlab.machine.device",
    "time_call": "kvlab.machine.timing",
    "time_interleaved": "kvlab.machine.timing",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
