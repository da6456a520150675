import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvlab import Decoder, get_model
from kvlab.machine.timing import Bandwidth
from kvlab.measure.step_time import breakdown, breakdown_table
from kvlab.measure.sweep import Arm, interleaved_sweeps, sweep_context
from kvlab.metrics import RequestTiming, fit_line, percentile, summarize
from kvlab.model.weights import numpy_openblas, weight_kernel
from kvlab.roofline import weight_bytes_read

from .helpers import tiny_config


def test_percentile_matches_numpy_linear_interpolation():
    rng = np.random.default_rng(0)
    values = list(rng.exponential(size=37))
    for p in (0, 13, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p), rel=1e-12)
    with pytest.raises(ValueError, match="p: 101"):
        percentile(values, 101)
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_vllm_metric_definitions_on_known_timestamps():
    r = RequestTiming((0.100, 0.110, 0.125, 0.130))  # seconds since the request started
    assert r.ttft_ms == pytest.approx(100)
    assert r.e2el_ms == pytest.approx(130)
    assert r.itl_ms == pytest.approx([10, 15, 5])
    assert r.tpot_ms == pytest.approx((130 - 100) / 3)
    assert summarize("itl", r.itl_ms) == pytest.approx(
        {"mean_itl_ms": 10, "median_itl_ms": 10, "std_itl_ms": (50 / 3) ** 0.5, "p90_itl_ms": 14, "p99_itl_ms": 14.9}
    )
    with pytest.raises(ValueError, match="2 output tokens"):
        _ = RequestTiming((0.1,)).tpot_ms


def test_fit_line_recovers_a_known_line_and_reports_r2():
    x = [1, 2, 3, 4, 5]
    fit = fit_line(x, [2 * v + 1 for v in x])
    assert (fit.slope, fit.intercept, fit.r2) == pytest.approx((2, 1, 1))
    noisy = fit_line(x, [3.0, 4.8, 7.2, 9.0, 11.1])
    ref_slope, ref_intercept = np.polyfit(x, [3.0, 4.8, 7.2, 9.0, 11.1], 1)
    assert (noisy.slope, noisy.intercept) == pytest.approx((ref_slope, ref_intercept))
    assert 0.99 < noisy.r2 < 1
    with pytest.raises(ValueError, match="distinct"):
        fit_line([1, 1], [2, 3])


@pytest.mark.parametrize("fill", ["fast", "prefill"])
@pytest.mark.slow
def test_sweep_writes_vllm_named_json_and_a_plot(tmp_path, fill):
    model = Decoder(tiny_config(max_seq_len=512), device="cpu")
    sweep = sweep_context(model, [64, 16, 128], n_tokens=4, n_requests=2, fill=fill, progress=False)
    assert [p.context for p in sweep.points] == [16, 64, 128]
    sweep.save_json(tmp_path / "out.json")
    data = json.loads((tmp_path / "out.json").read_text())
    point = data["points"][0]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert f"{stat}_{metric}_ms" in point
    assert point["n_requests"] == 2 and point["output_len"] == 4
    fit = data["fit"]
    assert {"r2", "slope_us_per_token", "predicted_slope_us_per_token", "kv_bandwidth_fraction"} <= fit.keys()
    per_token = 2 * 2 * 2 * 16 * 4  # K+V, layers, KV heads, head dim, fp32
    assert data["kv_bytes_per_token"] == per_token
    assert fit["predicted_slope_us_per_token"] == pytest.approx(per_token / (sweep.bandwidth.read_gbps * 1e9) * 1e6)
    assert data["points"][2]["bytes_per_step"] - data["points"][0]["bytes_per_step"] == (128 - 16) * per_token
    sweep.plot(tmp_path / "out.png")
    assert (tmp_path / "out.png").stat().st_size > 10_000


def test_sweep_rejects_bad_arguments():
    model = Decoder(tiny_config(), device="cpu")
    with pytest.raises(ValueError, match="fill"):
        sweep_context(model, [8], fill="slow")
    with pytest.raises(ValueError, match="n_tokens"):
        sweep_context(model, [8], n_tokens=1)
    with pytest.raises(ValueError, match="contexts"):
        sweep_context(model, [0, 8])


@pytest.mark.slow
def test_sweep_visits_contexts_round_robin_and_keeps_all_but_the_warm_up_round():
    model = Decoder(tiny_config(max_seq_len=512), device="cpu")
    visits = []

    def make_cache(m, batch, capacity):
        visits.append(capacity)
        return m.new_cache(batch, capacity)

    sweep = sweep_context(model, [64, 16], n_tokens=3, n_requests=2, make_cache=make_cache, progress=False)
    # one warm-up cache first, then three rounds (one warm-up, two kept) over both contexts in order
    assert visits == [3] + [16 + 3, 64 + 3] * 3
    assert [len(p.requests) for p in sweep.points] == [2, 2]


@pytest.mark.slow
def test_interleaved_sweeps_visit_every_context_and_arm_in_turn_against_one_bandwidth():
    model = Decoder(tiny_config(max_seq_len=512), device="cpu")
    visits = []

    def recording(name):
        def make_cache(m, batch, capacity):
            visits.append((name, batch, capacity))
            return m.new_cache(batch, capacity)

        return make_cache

    arms = {"one": Arm(model, recording("one")), "two": Arm(model, recording("two"), batch=2)}
    sweeps = interleaved_sweeps(arms, [64, 16], n_tokens=3, n_requests=2, progress=False)
    # each arm's warm-up cache, then three rounds (one warm-up, two kept): every context, every arm in it, in turn
    passes = [(name, batch, c + 3) for c in (16, 64) for name, batch in (("one", 1), ("two", 2))]
    assert visits == [("one", 1, 3), ("two", 2, 3)] + passes * 3
    assert sweeps["one"].bandwidth is sweeps["two"].bandwidth
    assert [s.batch for s in sweeps.values()] == [1, 2]
    assert all(len(p.requests) == 2 for s in sweeps.values() for p in s.points)
    # batch 2 reads its own weight bytes (one more embedding row) and twice the K/V of batch 1 at each context
    one, two = sweeps["one"], sweeps["two"]
    extra = [t.bytes_per_step - o.bytes_per_step for o, t in zip(one.points, two.points, strict=True)]
    rows = two.weight_bytes_read - one.weight_bytes_read
    assert rows == weight_bytes_read(model.cfg, batch=2) - weight_bytes_read(model.cfg) > 0
    assert extra == [rows + c * one.kv_bytes_per_token for c in (16, 64)]


def test_interleaved_sweeps_reject_bad_arguments():
    model = Decoder(tiny_config(), device="cpu")
    with pytest.raises(ValueError, match="arms"):
        interleaved_sweeps({}, [8])
    with pytest.raises(ValueError, match="n_requests"):
        interleaved_sweeps({"a": Arm(model)}, [8], n_requests=0)


@pytest.mark.slow
def test_a_sweep_of_one_context_has_no_line_and_says_so():
    model = Decoder(tiny_config(max_seq_len=512), device="cpu")
    sweep = sweep_context(model, [32], n_tokens=2, n_requests=1, progress=False)
    with pytest.raises(ValueError, match="at least two contexts"):
        sweep.fit  # noqa: B018
    assert set(sweep.summary()) == {"predicted_slope_us_per_token", "predicted_intercept_ms"}
    assert sweep.to_dict()["points"][0]["context"] == 32


@pytest.mark.slow
def test_bench_of_one_context_prints_its_tpot_and_says_there_is_no_line(tmp_path):
    """Runs the installed entry point, as a learner would. At one thread its header says whether one-row products
    ran on numpy's OpenBLAS (kvlab.model.weights), which this machine's answer decides."""
    cmd = [sys.executable, "-m", "kvlab.cli", "bench", "--preset", "cpu-tiny", "--contexts", "128", "--threads", "1"]
    cmd += ["--tokens", "3", "--requests", "1", "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "no line to fit" in result.stdout and "Traceback" not in result.stderr
    on_openblas = "runtime eager (one-row products on numpy's OpenBLAS)" in result.stdout
    assert on_openblas == (numpy_openblas() is not None), result.stdout
    assert [p["context"] for p in json.loads((tmp_path / "b.json").read_text())["points"]] == [128]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("runtime", "needs", "header"),
    [("onnx", "onnxruntime", "runtime onnx (one graph a step)"),
     ("numba", "numba", "runtime numba (one compiled call a step, on one thread)")],
)  # fmt: skip
def test_bench_measures_a_compiled_runtime(tmp_path, runtime, needs, header):
    """``kvlab bench --runtime`` through the installed entry point: it says which runtime it measured, and the
    runtime's compile and caches write no warning."""
    pytest.importorskip(needs)
    cmd = [sys.executable, "-m", "kvlab.cli", "bench", "--preset", "cpu-tiny", "--contexts", "64,128", "--runtime"]
    cmd += [runtime, "--tokens", "3", "--requests", "1", "--threads", "1", "--json", str(tmp_path / "b.json")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert header in result.stdout and "fit:" in result.stdout, result.stdout
    assert "R^2 n/a (a line through two points fits them exactly)" in result.stdout  # not a perfect-looking 1.0000
    assert result.stderr.count("Warning") == 0, result.stderr
    assert json.loads((tmp_path / "b.json").read_text())["runtime"] == runtime  # what the sweep's model ran


@pytest.mark.slow
def test_bench_reads_the_weights_in_the_precision_asked_and_names_its_kernel(tmp_path):
    """``kvlab bench --weight-dtype fp16`` through the installed entry point: the header names the kernel this CPU
    ran, and the prediction charges two bytes a weight."""
    cmd = [sys.executable, "-m", "kvlab.cli", "bench", "--preset", "cpu-tiny", "--contexts", "64,128", "--tokens"]
    cmd += ["3", "--requests", "1", "--threads", "1", "--weight-dtype", "fp16", "--json", str(tmp_path / "b.json")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"weights fp16 on {weight_kernel('fp16', 'cpu')};" in result.stdout, result.stdout
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["weight_dtype"] == "fp16"
    assert saved["weight_bytes_read"] == weight_bytes_read(Decoder(get_model("cpu-tiny"), weight_dtype="fp16").cfg)
    assert saved["weight_bytes_read"] * 2 == pytest.approx(weight_bytes_read(get_model("cpu-tiny")), rel=0.01)


def test_sweep_refuses_a_bandwidth_measured_with_other_threads():
    model = Decoder(tiny_config(), device="cpu")
    other = torch.get_num_threads() + 1
    bw = Bandwidth("cpu", 256.0, 10.0, 12.0, 11.0, 13.0, threads=other)
    with pytest.raises(ValueError, match=f"bandwidth: measured with {other} threads"):
        sweep_context(model, [8], n_tokens=2, n_requests=1, bandwidth=bw, progress=False)
    # the prediction divides by the read bandwidth, not the copy bandwidth
    bw = Bandwidth("cpu", 256.0, 10.0, 12.0, 11.0, 13.0, threads=torch.get_num_threads())
    sweep = sweep_context(model, [8, 16], n_tokens=2, n_requests=1, bandwidth=bw, progress=False)
    point = sweep.points[0]
    assert point.predicted_tpot_ms == pytest.approx(point.bytes_per_step / 12e9 * 1e3, rel=1e-12)


def test_decode_breakdown_counts_every_weight_and_kv_byte_once():
    cfg = tiny_config(n_kv_heads=4)  # d_model 64, d_ff 96, vocab 101, 2 layers, head dim 16
    model = Decoder(cfg, device="cpu")
    result = breakdown(model, context=20, repeats=2, clock="thread", buffer_mb=1, warmup=1)
    # per layer: QKV 64x(64+2*64), O 64x64, gate+up 64x(2*96), down 96x64; then the tied head 101x64; fp32
    layer = (64 * 192 + 64 * 64 + 64 * 192 + 96 * 64) * 4
    assert result["weight_bytes"] == [layer, layer, 101 * 64 * 4]
    # 19 tokens filled; the warm-up step attends over 20, the two timed repeats over 21 and 22: bytes at 21
    assert result["kv_context"] == 21
    assert result["kv_bytes"] == [2 * 4 * 16 * 4 * 21] * 2  # K and V, 4 heads of 16, fp32
    assert result["context_end"] == 22
    assert len(result["ms"]["matvec"]) == 3
    assert all(len(result["ms"][part]) == 2 for part in ("attention", "scores", "values", "k_stream", "v_stream"))
    assert result["read_gbps"] > 0 and result["copy_gbps"] > 0
    assert "rest (norms, RoPE, ...)" in "\n".join(breakdown_table(result))
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="clock: 'thread' counts one thread"):
            breakdown(model, context=20, repeats=1, clock="thread")
    finally:
        torch.set_num_threads(1)
