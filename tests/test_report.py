"""``kvlab report``: its figures are ``kvlab predict --json``'s, for every preset and a config.json of its own, the
files render, and bad input is refused with the flag named."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.report.build import LESSONS, quality_table, quality_table_from_measurements
from kvlab.roofline import crossover_context
from kvlab.spec.presets import model_presets
from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
GPU = ["--gpu", "h100-sxm"]

# A Qwen2.5-14B-like shape written with its own keys (none of the presets is it): GQA 40/8, untied, 32k positions.
QWEN_LIKE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "_name_or_path": "team/qwen-like-14b",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 131072,
    "torch_dtype": "bfloat16",
}
# A Mistral-like shape whose layers alternate local (4k window) and global, given by layer_types.
LOCAL_GLOBAL = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32768,
    "max_position_embeddings": 131072,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 16,
    "torch_dtype": "bfloat16",
}


def predict_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "predict", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def report(capsys, tmp_path: Path, *argv: str, json_only: bool = True) -> dict:
    out = tmp_path / "out"
    code, printed, err = run_cli(capsys, "report", *argv, *(["--json-only"] if json_only else []), "--out", str(out))
    assert code == 0, err
    assert printed.splitlines()[-1].startswith("wrote ")
    return json.loads((out / "report.json").read_text())


def check_against_predict(capsys, r: dict, model: list[str]) -> None:
    """Every figure the report shares with ``kvlab predict --json`` for the same arguments is equal, exactly."""
    i = r["inputs"]
    base = [*model, *GPU, "--context", str(i["context"]), "--batch", str(i["batch"])]
    plain = predict_json(capsys, *base)
    assert r["prediction"] == plain
    for key in ("weight_bytes", "weight_bytes_read", "active_params", "experts_read", "kv_bytes_per_token"):
        assert r["breakdown"][key] == plain[key]
    for row in r["mitigations"]:  # each row records the flags that reproduce it; a later --context wins
        assert row["prediction"] == predict_json(capsys, *base, *row["predict_flags"]), row["key"]
        shown = row["prediction"].get("speculative", row["prediction"])
        assert row["tpot_ms"] == shown["tpot_ms"] and row["speedup"] == plain["tpot_ms"] / shown["tpot_ms"]
    for curve in r["curves"]:
        at = curve["context"].index(i["context"])
        point = predict_json(capsys, *model, *GPU, "--context", str(i["context"]), "--batch", str(curve["batch"]))
        assert curve["tpot_ms"][at] == point["tpot_ms"] and curve["tpot_ms_range"][at] == list(point["tpot_ms_range"])
        assert curve["memory_needed_bytes"][at] == point["memory_needed_bytes"]
    for c in r["crossover"]:
        one = predict_json(capsys, *model, *GPU, "--context", "1", "--batch", str(c["batch"]))
        assert c["weight_bytes_read"] == one["weight_bytes_read"]
        if c["by"] == "crossover_context":
            assert c["context"] == crossover_context(one["weight_bytes_read"], plain["kv_bytes_per_token"], c["batch"])
    m = r["memory"]
    assert m["memory_bytes"] == plain["gpu_memory_bytes"] and m["fits"] == (
        plain["memory_needed_bytes"] <= plain["gpu_memory_bytes"]
    )
    if m["max_batch_at_context"]:  # the largest batch fits and one more does not, as predict counts them
        for b, fits in ((m["max_batch_at_context"], True), (m["max_batch_at_context"] + 1, False)):
            need = predict_json(capsys, *model, *GPU, "--context", str(i["context"]), "--batch", str(b))
            assert (need["memory_needed_bytes"] <= m["memory_bytes"]) == fits


@pytest.mark.parametrize("name", list(model_presets()))
def test_report_numbers_are_predicts_for_every_preset(capsys, tmp_path: Path, name: str) -> None:
    r = report(capsys, tmp_path, "--model", name, *GPU, "--batch", "4")
    # the 32k default, clipped to a shorter model's max context
    assert r["inputs"]["context"] == min(32 * 1024, model_presets()[name].max_seq_len)
    check_against_predict(capsys, r, ["--model", name])


@pytest.mark.parametrize("shape", [QWEN_LIKE, LOCAL_GLOBAL], ids=["qwen-like", "local-global"])
def test_report_numbers_are_predicts_for_a_config_json(capsys, tmp_path: Path, shape: dict) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(shape))
    r = report(capsys, tmp_path, "--config", str(config), *GPU, "--context", "16k", "--batch", "8")
    check_against_predict(capsys, r, ["--config", str(config)])
    local = "layer_types" in shape
    assert all(c["by"].startswith("kv_bytes_per_step") == local for c in r["crossover"])
    assert any("local" in note for note in r["breakdown"]["notes"]) == local


def test_crossover_on_local_layers_is_where_kv_passes_the_weights(capsys, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LOCAL_GLOBAL))
    r = report(capsys, tmp_path, "--config", str(config), *GPU, "--batch", "8")
    (c,) = [c for c in r["crossover"] if c["batch"] == 8]
    kv = [
        predict_json(capsys, "--config", str(config), *GPU, "--context", str(n), "--batch", "8")["kv_bytes"]
        for n in (c["context"] - 1, c["context"])
    ]
    assert kv[0] < c["weight_bytes_read"] <= kv[1]


def test_report_renders_a_self_contained_page(capsys, tmp_path: Path) -> None:
    r = report(capsys, tmp_path, "--model", "llama-3.1-8b", *GPU, "--context", "32k", "--batch", "8", json_only=False)
    out = tmp_path / "out"
    for name in ("index.html", "report.md", "tpot_vs_context.png", "mitigations.png", "memory.png"):
        assert (out / name).stat().st_size > 0, name
    page = (out / "index.html").read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert sources and all(s.startswith("data:") for s in sources), sources  # nothing to fetch beside the page
    assert len(re.findall(r"<img ", page)) == 3
    md = (out / "report.md").read_text()
    for row in r["mitigations"]:
        assert row["name"] in md and row["name"] in page and LESSONS[row["lesson"]] in md
    # the figures the summary states are predict's, as the predict table prints them
    summary = md.split("## Bytes per step")[0]
    assert f"TPOT {r['prediction']['tpot_ms']:,.2f} ms" in summary and "16.06 GB of weights" in summary
    assert "StreamingLLM's default" in md and "assumed 2,048-token system prompt" in md
    assert "assumed cap of 8,192 tokens" in md and "published_speculative.csv row 1" in md


def test_each_mitigation_names_its_lesson_cost_and_source(capsys, tmp_path: Path) -> None:
    r = report(capsys, tmp_path, "--model", "llama-3.1-70b", *GPU, "--context", "32k", "--batch", "8")
    rows = {row["key"]: row for row in r["mitigations"]}
    assert set(rows) == {"kv-fp8", "kv-int8", "kv-int4", "window-sinks", "shared-prefix", "session-cap", "speculative"}
    assert {row["lesson"] for row in rows.values()} == {"05", "07", "08", "09", "10"}
    assert all(row["quality"] and row["citation"] and row["assumption"] for row in rows.values())
    full = next(q for q in quality_table()["rows"] if q["policy"] == "full" and q["context"] == 512)
    assert f"perplexity {full['ppl']:.3f} -> " in rows["kv-int4"]["quality"]
    assert rows["window-sinks"]["predict_flags"] == ["--window", "1020", "--sinks", "4"]
    spec = r["speculative_assumption"]
    assert spec["row"]["acceptance_rate"] == 0.5561 and spec["row"]["k"] == 15
    assert round(spec["acceptance"], 2) == 0.92  # docs/reference.md: the vLLM table's 0.556 at k = 15 is a = 0.92
    # the draft's own weights and KV sit in memory beside the target's
    assert rows["speculative"]["memory_needed_bytes"] > r["prediction"]["memory_needed_bytes"]
    # 70B in bf16 does not fit one H100: the report says how many
    m = r["memory"]
    assert not m["fits"] and m["max_batch_at_context"] == 0 and m["devices_needed"] == 3


def test_memory_gb_overrides_the_gpu_and_bandwidth_alone_leaves_memory_unjudged(capsys, tmp_path: Path) -> None:
    r = report(capsys, tmp_path, "--model", "llama-3.1-70b", *GPU, "--memory-gb", "640", "--batch", "8")
    assert r["memory"]["memory_source"] == "--memory-gb" and r["memory"]["fits"]
    assert r["prediction"]["gpu_memory_bytes"] == 80 * 10**9  # predict's own figure stays the GPU's
    r = report(capsys, tmp_path, "--model", "llama-3.1-8b", "--bandwidth", "1000")
    assert r["memory"] is None and r["inputs"]["gpu"] is None
    r = report(
        capsys,
        tmp_path,
        "--model",
        "llama-3.1-8b",
        "--bandwidth",
        "1000",
        "--memory-gb",
        "24",
        "--context",
        "8k",
        "--batch",
        "2",
    )
    m = r["memory"]
    assert (
        m["memory_bytes"] == 24 * 10**9
        and m["memory_source"] == "--memory-gb"
        and "gpu_memory_bytes" not in r["prediction"]
    )
    assert (
        2 * m["kv_bytes_per_sequence"]
        <= m["free_for_kv_bytes"]
        < (m["max_batch_at_context"] + 1) * m["kv_bytes_per_sequence"]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-9"], "--model: unknown preset 'llama-9'; allowed: cpu-tiny"),
        (["--model", "llama-3.1-8b", "--batch=-1"], "--batch: '-1'; allowed: an integer >= 1"),
        (["--model", "llama-3.1-8b", "--batch", "0"], "--batch: '0'; allowed: an integer >= 1"),
        (["--model", "llama-2-7b", "--context", "8k"], "--context: 8,192 tokens; allowed: at most llama-2-7b's"),
        (["--model", "llama-3.1-8b", "--memory-gb", "-4"], "--memory-gb: '-4'; allowed: a number > 0"),
        (["--model", "llama-3.1-8b", "--context", "lots"], "--context: 'lots' is not a token count"),
    ],
)
def test_bad_input_names_the_flag(capsys, tmp_path: Path, argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, "report", *argv, *GPU, "--out", str(tmp_path / "out"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_written_is_named(capsys, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_cli(capsys, "report", "--model", "llama-3.1-8b", *GPU, "--out", str(blocker / "report"))
    assert code == 2 and err.startswith("kvlab report: error: --out: ") and "allowed:" in err


def test_a_config_missing_a_key_is_named(capsys, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({k: v for k, v in QWEN_LIKE.items() if k != "hidden_size"}))
    code, _, err = run_cli(capsys, "report", "--config", str(config), *GPU, "--out", str(tmp_path / "out"))
    assert code == 2 and "--config:" in err and "missing hidden_size" in err


def test_shipped_quality_table_is_the_one_in_docs_measurements() -> None:
    parsed = quality_table_from_measurements((REPO / "docs" / "measurements.md").read_text())
    assert quality_table() == parsed
    policies = {"full", "fp8", "fp8-tensor", "int8", "int4", "window-256", "h2o-128"}
    assert policies <= {row["policy"] for row in parsed["rows"]}


def test_report_without_measure_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from kvlab.cli import main; "
        f"main(['report', '--model', 'qwen3-8b', '--gpu', 'h100-sxm', '--out', {str(tmp_path)!r}]); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.slow
def test_measure_adds_this_machines_sweep(capsys, tmp_path: Path) -> None:
    r = report(capsys, tmp_path, "--model", "qwen3-8b", *GPU, "--measure", json_only=False)
    s = r["measured"]
    assert s["model"] == "cpu-small" and [p["context"] for p in s["points"]] == [1024, 4096, 8192]
    assert s["bandwidth"]["read_gbps"] > 0 and "r2" in s["fit"]
    assert (tmp_path / "out" / "measured.png").stat().st_size > 0
    page = (tmp_path / "out" / "index.html").read_text()
    assert "Measured on this machine" in page and page.count("<img ") == 4 and "this machine (cpu-small" in page


def test_the_speculative_draft_always_shares_the_targets_vocabulary() -> None:
    from kvlab.report.build import _speculative_assumption
    from kvlab.spec.presets import get_model, same_vocabulary

    kinds = {}
    for name, cfg in model_presets().items():
        spec = _speculative_assumption(cfg)
        kinds[name] = spec["kind"], spec["draft"]
        if spec["draft"] is not None:
            assert same_vocabulary(cfg, get_model(spec["draft"])) is None, name
        else:
            assert 0 < spec["draft_fraction"] < 1 and "assumption" in spec["why"], name
    assert kinds["llama-3.1-70b"] == ("preset", "llama-3.1-8b")
    assert kinds["deepseek-v3"] == ("head", "deepseek-v3-mtp")  # the multi-token-prediction module it ships
    for name in ("gemma-3-27b", "gemma-2-9b", "llama-3.1-8b"):
        assert kinds[name] == ("fraction", None), name  # no smaller preset of its vocabulary


def test_deepseek_v3_report_drafts_with_its_mtp_head(capsys, tmp_path: Path) -> None:
    r = report(capsys, tmp_path, "--model", "deepseek-v3", "--gpu", "h200-sxm", "--context", "32k", "--batch", "8")
    row = next(row for row in r["mitigations"] if row["key"] == "speculative")
    assert row["predict_flags"][-2:] == ["--draft-model", "deepseek-v3-mtp"]
    assert "llama" not in (row["assumption"] + " ".join(row["predict_flags"])).lower()
    spec = row["prediction"]["speculative"]
    assert spec["k"] <= 1 and spec["verify_bytes_per_step"] > spec["target_bytes_per_step"]
    assert "arXiv 2412.19437" in row["citation"] and "README_WEIGHTS.md" in row["citation"]


def test_fp8_row_models_vllms_per_tensor_cache_with_the_per_tensor_quality(capsys, tmp_path: Path) -> None:
    r = report(capsys, tmp_path, "--model", "gemma-3-27b", *GPU, "--context", "32k", "--batch", "8")
    rows = {row["key"]: row for row in r["mitigations"]}
    fp8 = rows["kv-fp8"]
    assert fp8["predict_flags"] == ["--kv-dtype", "fp8"] and "one scale per tensor" in fp8["assumption"]
    assert "zero point" not in fp8["assumption"] and "per-tensor scale, the vLLM default" in fp8["name"]
    # The quality quoted is the measured fp8-tensor row (scale 1.0), not kvlab's per-group fp8 row.
    table = json.loads((REPO / "kvlab" / "data" / "quality_table.json").read_text())["rows"]
    measured = {row["policy"]: row for row in table if row["context"] == 512}
    assert f"-> {measured['fp8-tensor']['ppl']:.3f}" in fp8["quality"] and "left at 1.0" in fp8["quality"]
    assert "row fp8-tensor at 512 tokens" in fp8["citation"] and "vllm-project/vllm" in fp8["citation"]
    assert f"-> {measured['int8']['ppl']:.3f}" in rows["kv-int8"]["quality"]
    assert "scale and zero point per group of 32" in rows["kv-int8"]["assumption"]
    assert r["memory"]["fits"] and r["memory"]["max_batch_at_context"] == 8  # tied embeddings: 54.02 GB of weights
