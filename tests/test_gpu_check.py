"""benchmarks/gpu_check.py's CPU dry run: every section recorded, every target with its numbers, the plots."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
SECTIONS = {"bandwidth", "parity", "pytest_gpu", "fidelity", "kernels", "cuda_graphs", "triton_interpreter"}
TARGETS = {"decode_copy_bandwidth_fraction", "codec_slope_int8", "codec_slope_int4", "codec_slope_fp8",
           "paged_vs_contiguous"}  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), out


@pytest.mark.slow
def test_the_dry_run_records_the_machine_and_every_section(dry_run):
    report, _ = dry_run
    assert {"schema", "device", "dtype", "quick", "plan", "machine", "sections", "targets", "plots", "total_s"} <= set(
        report
    )
    assert (report["device"], report["dtype"], report["quick"]) == ("cpu", "fp32", True)
    assert report["machine"]["name"] and report["machine"]["torch"] and "triton" in report["machine"]
    assert set(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] in ("ok", "not_applicable"), f"{name}: {section['error'] or section['reason']}"
        assert section["seconds"] >= 0
    assert report["sections"]["pytest_gpu"]["status"] == "not_applicable"
    assert report["sections"]["parity"]["result"]["max_abs_logit_diff"] <= 1e-4


@pytest.mark.slow
def test_measured_and_predicted_sit_side_by_side(dry_run):
    sections = dry_run[0]["sections"]
    assert sections["bandwidth"]["result"]["copy_gbps"] > 0
    for batch in ("batch_1", "batch_2"):
        for p in sections["fidelity"]["result"][batch]["points"]:
            assert p["tpot_ms"] > 0 and p["predicted_tpot_ms"] > 0 and p["copy_fraction"] > 0
    kernels = sections["kernels"]["result"]
    for name in ("sdpa", "contiguous", "paged", "int8", "int4", "fp8"):
        assert all(p["ms"] > 0 and p["predicted_ms"] > 0 for p in kernels[name]["points"]), name
        assert "slope_us_per_token" in kernels[name]
    graphs = sections["cuda_graphs"]["result"]
    assert graphs["modes"] == ["contiguous", "static"] and "not applicable on cpu" in graphs["graph"]
    assert {"contiguous", "static"} <= set(graphs["batches"]["batch_1"]["fits"])


@pytest.mark.slow
def test_every_target_is_recorded_with_its_numbers_and_not_judged_on_a_cpu(dry_run):
    targets = {t["name"]: t for t in dry_run[0]["targets"]}
    assert set(targets) == TARGETS
    for t in targets.values():
        assert t["status"] == "not_applicable" and t["measured"] and t["target"], t


@pytest.mark.slow
def test_the_plots_are_pngs(dry_run):
    report, out = dry_run
    assert report["plots"] == ["fidelity.png", "kernels.png", "cuda_graphs.png"]
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_name_the_field(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with pytest.raises(ValueError, match="--dtype: unknown dtype 'int8'; allowed: fp32, bf16, fp16"):
        gpu_check.parse_args(["--device", "cpu", "--dtype", "int8", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--budget-s: 0"):
        gpu_check.parse_args(["--device", "cpu", "--budget-s", "0", "--out", str(tmp_path)])
