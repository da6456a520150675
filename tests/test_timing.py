"""kvlab.machine.timing and .isa: the one timer, the machine record, the bandwidth and FLOP/s probes, and the
instruction-set caps."""

import math
import time

import pytest

from kvlab.machine import isa
from kvlab.machine.device import last_level_cache_bytes
from kvlab.machine.isa import ISA_CAPS, capped_environ, isa_caps_in_effect
from kvlab.machine.timing import (
    Stopwatch,
    bandwidth_buffer_mb,
    machine_info,
    measure_bandwidth,
    measure_matmul_flops,
    time_call,
    time_interleaved,
)


def test_time_call_runs_the_warmup_untimed_then_times_each_repeat():
    calls = []
    times = time_call(lambda: calls.append(len(calls)), repeats=4, warmup=2, device="cpu")
    assert len(calls) == 6 and len(times) == 4
    assert all(t >= 0 for t in times)


def test_wall_clock_counts_a_sleep_and_the_thread_clock_does_not():
    wall = time_call(lambda: time.sleep(0.05), repeats=1, warmup=0, device="cpu")[0]
    thread = time_call(lambda: time.sleep(0.05), repeats=1, warmup=0, device="cpu", clock="thread")[0]
    assert wall >= 0.05
    assert thread < 0.025  # a sleeping thread uses almost no CPU; half the sleep leaves room for a loaded machine


def test_stopwatch_marks_increase_from_its_start():
    watch = Stopwatch("cpu")
    time.sleep(0.01)
    watch.mark()
    time.sleep(0.01)
    assert watch.elapsed() >= 0.02
    first, second = watch.times_s()
    assert 0.01 <= first < second


def test_interleaved_timing_calls_every_function_once_per_round():
    order = []
    times = time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=2, warmup=1)
    assert order == ["a", "b"] * 3
    assert [len(t) for t in times.values()] == [2, 2]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(repeats=1, clock="cpu"), "clock: 'cpu'; allowed: 'wall', 'thread'"),
        (dict(repeats=0), "repeats: 0"),
        (dict(repeats=1, warmup=-1), "warmup: -1"),
    ],
)
def test_bad_timer_arguments_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        time_call(lambda: None, **kwargs)


def test_machine_info_records_what_a_timing_depends_on(monkeypatch):
    for name in ISA_CAPS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    info = machine_info()
    assert {"cpu", "logical_cpus", "threads", "python", "torch", "platform"} <= set(info)
    assert isinstance(info["threads"], int) and info["threads"] >= 1
    assert "isa_caps" not in info
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # a cap set by hand, at any value, is recorded too
    assert machine_info()["isa_caps"] == "ONEDNN_MAX_CPU_ISA=AVX512_CORE"


def test_an_isa_cap_sets_every_librarys_variable_and_refuses_what_it_cannot_cap(monkeypatch):
    base = {"PATH": "/bin", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}
    with pytest.raises(ValueError, match="isa: 'avx512'; allowed: avx2"):
        capped_environ("avx512", base)
    monkeypatch.setattr(isa.platform, "machine", lambda: "arm64")
    with pytest.raises(ValueError, match="isa: 'avx2' caps x86 kernels; this machine is arm64"):
        capped_environ("avx2", base)
    monkeypatch.setattr(isa.platform, "machine", lambda: "AMD64")  # Windows spells x86-64 so
    monkeypatch.setattr(isa.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(ValueError, match="this CPU lacks it.*DEFAULT"):
        capped_environ("avx2", base)
    monkeypatch.setattr(isa.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    env = capped_environ("avx2", base)
    assert env["PATH"] == "/bin" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"  # the cap wins over what was set
    assert isa_caps_in_effect(env) == ISA_CAPS["avx2"] and isa_caps_in_effect({"PATH": "/bin"}) == {}


def _fake_cache(root, cpu, index, level, kind, size, shared=None):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")
    if shared is not None:
        (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_last_level_cache_counts_each_shared_instance_once(tmp_path):
    # two sockets of two CPUs: private 1 MiB L2s, and one 32 MiB L3 per socket shared by its two CPUs
    for cpu in range(4):
        _fake_cache(tmp_path, cpu, 0, 1, "Data", "32K", str(cpu))
        _fake_cache(tmp_path, cpu, 1, 1, "Instruction", "32K", str(cpu))
        _fake_cache(tmp_path, cpu, 2, 2, "Unified", "1024K", str(cpu))
        _fake_cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    assert last_level_cache_bytes(tmp_path) == 2 * 32 * 2**20


def test_last_level_cache_survives_missing_or_garbled_sysfs(tmp_path, monkeypatch):
    monkeypatch.setattr("kvlab.machine.device.platform.system", lambda: "Linux")  # no sysctl fallback
    assert last_level_cache_bytes(tmp_path / "absent") is None
    _fake_cache(tmp_path, 0, 0, 2, "Unified", "4M")  # no shared_cpu_list: counted once per level
    _fake_cache(tmp_path, 1, 0, 2, "Unified", "4M")
    _fake_cache(tmp_path, 0, 1, "three", "Unified", "260M")  # unreadable level: skipped
    _fake_cache(tmp_path, 1, 1, 3, "Unified", "lots")  # unreadable size: skipped
    assert last_level_cache_bytes(tmp_path) == 4 * 2**20


def test_bandwidth_buffer_exceeds_the_last_level_cache_with_a_floor():
    mib = 2**20
    assert bandwidth_buffer_mb(llc_bytes=260 * mib) == 1091  # ceil(4 * 272,629,760 / 1e6)
    assert bandwidth_buffer_mb(quick=True, llc_bytes=260 * mib) == 546  # ceil(2 * 272,629,760 / 1e6)
    assert bandwidth_buffer_mb(llc_bytes=32 * mib) == 256  # 134 MB is under the floor
    assert bandwidth_buffer_mb(quick=True, llc_bytes=32 * mib) == 68  # ceil(2 * 33,554,432 / 1e6)
    assert bandwidth_buffer_mb(quick=True, llc_bytes=16 * mib) == 64
    assert bandwidth_buffer_mb(llc_bytes=0) == 256


def test_measured_ceilings_are_positive_and_consistent():
    bw = measure_bandwidth("cpu", size_mb=16, repeats=3)
    for value in (bw.copy_gbps, bw.read_gbps):
        assert math.isfinite(value) and value > 0
    assert bw.copy_best_gbps >= bw.copy_gbps and bw.read_best_gbps >= bw.read_gbps
    assert measure_matmul_flops("cpu", n=128, repeats=2) > 0
