import json
import subprocess
import sys

import pytest

from kvlab import get_model
from kvlab.cli import UsageError, _r_squared, _share, parse_tokens
from kvlab.roofline import param_count
from tests.helpers import run_cli


def test_predict_reproduces_the_worked_example(capsys):
    code, out, _ = run_cli(capsys, "predict", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--context", "30000")
    assert code == 0
    assert "327,680 B" in out and "9.83 GB" in out and "141.11 GB" in out and "45.06 ms" in out
    assert "more than one h100-sxm's 80 GB" in out


def test_predict_speculation_divides_the_round_by_the_expected_tokens(capsys):
    base = ["predict", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--context", "8k", "--json"]
    _, plain, _ = run_cli(capsys, *base)
    code, out, _ = run_cli(capsys, *base, "--speculate", "4", "--acceptance", "0.5", "--draft-model", "llama-3.1-8b")
    assert code == 0
    step, spec = json.loads(plain)["bytes_per_step"], json.loads(out)["speculative"]
    _, draft, _ = run_cli(
        capsys, "predict", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--context", "8k", "--json"
    )
    draft_step = json.loads(draft)["bytes_per_step"]
    tokens = 1 + 0.5 + 0.25 + 0.125 + 0.0625
    assert spec["draft_bytes_per_step"] == draft_step and spec["tokens_per_step"] == tokens
    # a dense target's verify step reads the plain step and the 4 drafted positions' KV
    verify = step + 4 * json.loads(plain)["kv_bytes_per_token"]
    assert spec["verify_bytes_per_step"] == verify and spec["bytes_per_token"] == (verify + 4 * draft_step) / tokens
    code, out, _ = run_cli(capsys, *base[:-1], "--speculate", "3", "--acceptance", "0.8")
    assert code == 0 and "k=3 drafts at per-position acceptance a = 0.8: 2.95 tokens per verify step" in out
    assert "a drafter that reads no bytes (prompt lookup)" in out and "TPOT, speculative" in out


def test_predict_json_fields(capsys):
    code, out, _ = run_cli(
        capsys,
        "predict",
        "--model",
        "llama-3.1-8b",
        "--bandwidth",
        "1000",
        "--context",
        "8k",
        "--batch",
        "4",
        "--kv-dtype",
        "float8",
        "--weight-dtype",
        "bfloat16",
        "--json",
    )
    data = json.loads(out)
    assert code == 0
    assert data["kv_bytes_per_token"] == 2 * 32 * 8 * 128
    assert data["kv_bytes"] == 4 * 8192 * data["kv_bytes_per_token"]
    assert data["bytes_per_step"] == data["weight_bytes"] + data["kv_bytes"]
    assert data["tpot_ms"] == pytest.approx(data["bytes_per_step"] / 1e12 * 1e3)
    assert (data["kv_dtype"], data["weight_dtype"]) == ("fp8", "bf16")


def test_predict_window_sinks_and_shared_prefix(capsys):
    base = ["predict", "--model", "llama-3.1-8b", "--bandwidth", "300", "--context", "32k", "--batch", "8", "--json"]
    full = json.loads(run_cli(capsys, *base)[1])
    windowed = json.loads(run_cli(capsys, *base, "--window", "1020", "--sinks", "4")[1])
    shared = json.loads(run_cli(capsys, *base, "--shared-prefix", "16k")[1])
    per_token = full["kv_bytes_per_token"]
    assert full["kv_bytes"] == 8 * 32768 * per_token
    assert windowed["kv_bytes"] == 8 * 1024 * per_token
    assert shared["kv_bytes"] == (16384 + 8 * 16384) * per_token
    assert (windowed["window"], windowed["sinks"], shared["shared_prefix"]) == (1020, 4, 16384)
    int4 = json.loads(run_cli(capsys, *base, "--kv-dtype", "int4", "--group-size", "32")[1])
    assert int4["kv_bytes_per_token"] == per_token * (0.5 + 4 / 32) / 2  # bf16 is 2 bytes an element


def test_predict_charges_a_moe_step_the_experts_it_reads(capsys):
    base = ["predict", "--model", "deepseek-v3", "--gpu", "h200-sxm", "--context", "8k", "--json"]
    one = json.loads(run_cli(capsys, *base, "--batch", "1")[1])
    many = json.loads(run_cli(capsys, *base, "--batch", "256")[1])
    assert one["active_params"] / 1e9 == pytest.approx(37, abs=1)  # DeepSeek's "37B activated"
    assert one["weight_dtypes"] == {"embeddings": "bf16", "experts": "fp8", "other": "fp8"}
    assert one["weight_bytes_read"] < 0.06 * one["weight_bytes"] < many["weight_bytes_read"]
    assert many["weight_bytes_read"] > 0.99 * many["weight_bytes"]
    for data in (one, many):
        assert data["bytes_per_step"] == data["weight_bytes_read"] + data["kv_bytes"]
        assert data["tpot_ms"] == pytest.approx(data["bytes_per_step"] / 4.8e12 * 1e3)
        lo, hi = data["tpot_ms_range"]
        assert data["tpot_ms"] < lo < hi
    bf16 = json.loads(run_cli(capsys, *base, "--weight-dtype", "bf16")[1])
    assert (bf16["weight_dtype"], bf16["weight_bytes"]) == ("bf16", 2 * param_count(get_model("deepseek-v3")))
    assert set(bf16["weight_dtypes"].values()) == {"bf16"}


def test_predict_table_names_the_read_bytes_and_the_published_range(capsys):
    code, out, _ = run_cli(capsys, "predict", "--model", "gpt-oss-120b", "--gpu", "h100-sxm", "--context", "8k")
    assert code == 0
    assert "in bf16 (experts mxfp4)" in out and "4.0 of 128 routed experts" in out
    assert "TPOT, real systems" in out and "published decode measurements" in out


def test_predict_weight_group_size_and_input_embedding(capsys):
    base = ["predict", "--model", "llama-3.1-8b", "--bandwidth", "1000", "--context", "1k", "--json"]
    bf16 = json.loads(run_cli(capsys, *base)[1])
    int4 = json.loads(run_cli(capsys, *base, "--weight-dtype", "int4", "--weight-group-size", "64")[1])
    assert int4["weight_bytes"] == round(bf16["weight_bytes"] / 2 * 0.5625)
    rows = json.loads(run_cli(capsys, *base, "--input-embedding", "rows")[1])
    assert bf16["weight_bytes_read"] - rows["weight_bytes_read"] == (128256 - 1) * 4096 * 2


def test_predict_loads_no_torch():
    """``kvlab predict`` is arithmetic: a fresh process answers it, group scales included, without importing torch."""
    argv = ["predict", "--model", "deepseek-v3", "--gpu", "h200-sxm", "--context", "32k", "--kv-dtype", "int4"]
    code = (
        "import sys; from kvlab.cli import main; "
        f"assert main({argv + ['--group-size', '32', '--json']!r}) == 0; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["group_size"] == 32


def test_predict_reads_a_hugging_face_config(tmp_path, capsys):
    from kvlab import get_model

    (tmp_path / "config.json").write_text(json.dumps(get_model("llama-3.1-70b").to_hf_config()))
    code, out, _ = run_cli(
        capsys,
        "predict",
        "--config",
        str(tmp_path / "config.json"),
        "--gpu",
        "h100-sxm",
        "--context",
        "30000",
        "--json",
    )
    assert code == 0 and round(json.loads(out)["tpot_ms"], 1) == 45.1


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["predict", "--model", "llama-9", "--gpu", "h100-sxm", "--context", "1"], ["--model", "llama-3.1-8b"]),
        (["predict", "--model", "llama-3.1-8b", "--gpu", "h100", "--context", "1"], ["--gpu", "h100-sxm"]),
        (["predict", "--model", "llama-3.1-8b", "--bandwidth", "-3", "--context", "1"], ["--bandwidth", "> 0"]),
        (["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "lots"], ["--context", "32k"]),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--kv-dtype", "fp7"],
            ["--kv-dtype", "int4"],
        ),
        (["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--batch", "0"], ["--batch"]),
        (["predict", "--config", "/no/such/config.json", "--bandwidth", "9", "--context", "9"], ["--config"]),
        (["predict", "--model", "llama-3.1-8b", "--context", "9"], ["--gpu", "--bandwidth"]),
        (["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--sinks", "4"], ["--sinks"]),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--shared-prefix", "10"],
            ["--shared-prefix", "at most"],
        ),
        (["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--window", "0"], ["--window"]),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--group-size", "x"],
            ["--group-size"],
        ),
        (
            ["predict", "--model", "gemma-2-9b", "--bandwidth", "9", "--context", "9000"],
            ["--context", "at most gemma-2-9b's max_seq_len=8,192"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--weight-group-size", "32"],
            ["--weight-group-size", "int8 or int4"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--kv-dtype", "mxfp4"],
            ["--kv-dtype", "int4"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--acceptance", "0.5"],
            ["--acceptance", "--speculate"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--speculate", "4"],
            ["--acceptance", "--acceptance-rate", "[0, 1]"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--speculate", "4"]
            + ["--acceptance", "0.5", "--acceptance-rate", "0.5"],
            ["--acceptance, --acceptance-rate", "exactly one"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--speculate", "4"]
            + ["--acceptance-rate", "1.2"],
            ["--acceptance-rate", "'1.2'", "[0, 1]"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--acceptance-rate", "0.5"],
            ["--acceptance-rate", "--speculate"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--speculate", "4"]
            + ["--acceptance", "0.5", "--draft-fraction", "2"],
            ["--draft-fraction", "[0, 1]"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--speculate", "2"]
            + ["--acceptance", "1.5"],
            ["--acceptance", "probability"],
        ),
        (
            ["predict", "--model", "llama-3.1-8b", "--bandwidth", "9", "--context", "9", "--speculate", "2"]
            + ["--acceptance", "0.5", "--draft-model", "gpt-5"],
            ["--draft-model"],
        ),
        (["bench", "--preset", "mixtral-8x7b"], ["--preset", "cannot run yet", "mixture-of-experts"]),
        (["bench", "--fill", "slow"], ["--fill", "prefill"]),
        (["bench", "--runtime", "fast"], ["--runtime", "allowed: 'eager', 'onnx'"]),
        (["bench", "--preset", "smollm2-135m", "--runtime", "onnx"], ["--runtime", "is bf16", "cpu-small"]),
        (["bench", "--runtime", "onnx", "--device", "meta"], ["--runtime", "on meta", "--device cpu"]),
        (["bench", "--preset", "smollm2-135m", "--runtime", "onnx-packed"], ["--runtime: onnx-packed", "is bf16"]),
        (["bench", "--runtime", "onnx-packed", "--device", "meta"], ["--runtime: onnx-packed runs on the CPU"]),
        (["bench", "--preset", "smollm2-135m", "--runtime", "numba"], ["--runtime: numba runs fp32", "is bf16"]),
        (["bench", "--runtime", "numba", "--device", "meta"], ["--runtime: numba runs on the CPU"]),
        (["bench", "--weight-dtype", "int8", "--runtime", "numba"], ["--weight-dtype: int8 with --runtime numba"]),
        (["bench", "--endpoint", "http://127.0.0.1:9/v1", "--runtime", "onnx"], ["--runtime", "without --endpoint"]),
        (["bench", "--weight-dtype", "int4"], ["--weight-dtype", "'int4'", "allowed: fp32, bf16, fp16, int8"]),
        (["bench", "--weight-dtype", "fp16", "--runtime", "onnx"], ["--weight-dtype: fp16 with --runtime onnx"]),
        (["bench", "--weight-dtype", "int8", "--device", "meta"], ["--weight-dtype: 'int8' on meta", "allowed"]),
        (["bench", "--endpoint", "http://127.0.0.1:9/v1", "--weight-dtype", "fp16"], ["--weight-dtype", "--endpoint"]),
        (["bench", "--device", "gpu"], ["--device", "'gpu' is not a device", "allowed: 'cpu'"]),
        (["bench", "--device", "cuda:99"], ["--device", "'cuda:99'", "no such device", "allowed: 'cpu'"]),
        (["serve", "--model", "cpu-tiny", "--device", "cuda:99"], ["--device", "'cuda:99'", "allowed: 'cpu'"]),
        (["frobnicate"], ["predict", "bench"]),
    ],
)
def test_bad_arguments_give_one_line_naming_them_and_exit_2(capsys, argv, names):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1, err
    for name in names:
        assert name in err


def test_acceptance_rate_is_converted_to_the_per_position_probability(capsys):
    base = ["predict", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--context", "8k", "--speculate", "4"]
    code, out, _ = run_cli(capsys, *base, "--acceptance-rate", "0.5561", "--json")
    spec = json.loads(out)["speculative"]
    assert code == 0 and round(spec["acceptance"], 3) == 0.779 and round(spec["tokens_per_step"], 2) == 3.22
    code, out, _ = run_cli(capsys, *base, "--acceptance", "0.5561", "--json")
    assert round(json.loads(out)["speculative"]["tokens_per_step"], 2) == 2.13  # as a, the same figure is worth less


def test_acceptance_help_says_it_is_the_per_position_probability(capsys):
    code, out, _ = run_cli(capsys, "predict", "--help")
    text = " ".join(out.split())
    assert "the per-position acceptance probability a" in text and "accepted / drafted tokens at this K" in text


def test_moe_speculation_charges_the_verify_step_its_experts(capsys):
    base = ["predict", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--context", "4096", "--json"]
    code, out, _ = run_cli(capsys, *base, "--speculate", "4", "--acceptance", "0.8")
    spec = json.loads(out)["speculative"]
    assert code == 0 and spec["speedup"] == pytest.approx(1.22, abs=0.01)
    assert spec["verify_bytes_per_step"] > 2.7 * spec["target_bytes_per_step"]


@pytest.mark.parametrize(
    ("target", "draft", "names"),
    [
        ("deepseek-v3", "llama-3.1-8b", ["128,256", "129,280"]),
        ("gemma-3-27b", "llama-3.1-8b", ["128,256", "262,144"]),
        ("gpt-oss-120b", "llama-3.1-8b", ["128,256", "201,088"]),
        ("llama-2-70b", "mistral-7b-v0.1", ["mistral", "llama-2", "32,000"]),  # one size, two tokenizers
    ],
)
def test_a_draft_with_another_vocabulary_is_refused_naming_both(capsys, target, draft, names):
    code, _, err = run_cli(
        capsys, "predict", "--model", target, "--gpu", "h200-sxm", "--context", "4k", "--speculate", "2",
        "--acceptance", "0.7", "--draft-model", draft,
    )  # fmt: skip
    assert code == 2 and err.startswith("kvlab predict: error: --draft-model: ")
    for name in [target, draft, *names]:
        assert name in err


def test_predict_says_which_fp8_cache_it_counts(capsys):
    base = ["predict", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--context", "8k", "--kv-dtype", "fp8"]
    tensor = json.loads(run_cli(capsys, *base, "--json")[1])
    group = json.loads(run_cli(capsys, *base, "--group-size", "32", "--json")[1])
    assert tensor["kv_bytes_per_token"] == 32 * 8 * 128 * 2 and "one scale per tensor" in tensor["kv_scales"]
    assert "vLLM's default fp8" in tensor["kv_scales"]
    assert group["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 34 // 32 and "per group of 32" in group["kv_scales"]
    assert "zero point" not in group["kv_scales"]  # an fp8 group keeps a scale only
    int8 = json.loads(run_cli(capsys, *base[:-1], "int8", "--group-size", "32", "--json")[1])
    assert "scale and zero point" in int8["kv_scales"]


def test_token_counts_accept_k_and_m_suffixes():
    assert parse_tokens("32k") == 32768 and parse_tokens("1.5k") == 1536 and parse_tokens("30000") == 30000
    assert parse_tokens("1m") == 1024 * 1024 and parse_tokens("0.5M") == 512 * 1024
    for bad in ("m", "1g", "0.1k", "-1k"):
        with pytest.raises(UsageError, match="--context"):
            parse_tokens(bad)


def test_models_and_gpus_list_the_presets(capsys):
    _, out, _ = run_cli(capsys, "models")
    assert "llama-3.1-70b" in out and "deepseek-v3" in out and "no: mixture-of-experts" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line[:1].isalnum()}
    assert rows["cpu-small"][1] == "fp32" and rows["smollm2-135m"][1] == "bf16"  # what runtime='onnx' refuses
    assert "deepseek-v3, gpt-oss-20b, gpt-oss-120b" in out  # their narrower shipped weights
    assert "163,840" in out  # deepseek-v3's context
    _, out, _ = run_cli(capsys, "gpus")
    assert "h200-sxm" in out and "4,800 GB/s" in out
    assert "165.2 TF/s*" in out and "rtx-4090: BF16 165.2 and FP8 330.3 are with FP32 accumulate" in out


def test_bench_says_what_a_fit_cannot_tell():
    assert _share(0.66) == "66%"
    assert _share(float("nan")).startswith("n/a (the fitted term is not positive")
    assert _share(1.79) == "179% (above the read bandwidth: bytes served from a CPU cache, or a noisy fit)"
    assert _r_squared(2, 1.0) == "R^2 n/a (a line through two points fits them exactly)"
    assert _r_squared(4, 0.9871) == "R^2 0.9871"
    assert _r_squared(3, 0.0433) == "R^2 0.0433 (below 0.9: the points are far from a line; add --requests)"


def test_a_reader_that_stops_early_gets_no_traceback():
    """``kvlab models | head -1``: the pipe closes before kvlab writes, and kvlab leaves quietly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlab.cli", "models"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err


@pytest.mark.slow
def test_bench_writes_json_and_plot(tmp_path):
    """Runs the installed entry point, as a learner would."""
    cmd = [
        sys.executable,
        "-m",
        "kvlab.cli",
        "bench",
        "--preset",
        "cpu-tiny",
        "--contexts",
        "128,256,512",
        "--tokens",
        "3",
        "--requests",
        "1",
        "--json",
        str(tmp_path / "b.json"),
        "--plot",
        str(tmp_path / "b.png"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    assert [p["context"] for p in data["points"]] == [128, 256, 512]
    assert {"r2", "slope_us_per_token", "predicted_slope_us_per_token"} <= data["fit"].keys()
    assert "fit:" in result.stdout and (tmp_path / "b.png").exists()
    assert f"R^2 {data['fit']['r2']:.4f}" in result.stdout  # three points: a fit that could have missed


@pytest.mark.parametrize(
    ("contexts", "error"),
    [
        ("64,64", "--contexts: 64 is given twice; allowed: distinct lengths"),
        ("2k,4k,2048", "--contexts: 2048 and 2k are both 2,048 tokens; allowed: distinct lengths"),
        (" , ", "--contexts: ' , ' names no length; allowed: comma-separated"),
        ("", "--contexts: '' names no length; allowed: comma-separated"),
    ],
)
def test_bench_refuses_contexts_a_sweep_would_drop(capsys, contexts, error):
    """A sweep keeps one point per length: a repeat would drop out of the fit without a word."""
    for endpoint in ([], ["--endpoint", "http://127.0.0.1:9", "--model", "m"]):
        code, _, err = run_cli(capsys, "bench", "--preset", "cpu-tiny", "--contexts", contexts, *endpoint)
        assert code == 2 and error in err, err
