"""An autograde round trip on a temporary copy of the course, with synthetic students; scores come from the CSV.

- "perfect" submits the released lessons with the solutions' answers: full marks, and no cell anywhere raises or
  writes to stderr. This is the one run of every solution in quick mode with its hidden tests (what
  `autograde validate --all-cells` on a solution would check, so the suite does not run the notebooks twice).
- "blank" submits the released lessons untouched: zero, and not one test cell passes. This is the one run of every
  unanswered lesson (what `autograde validate --invert` on a lesson would check).
- "partial" submits two lessons only, answered with specific mistakes that fail known test cells (the exact partial
  score), and with one test cell edited, which grading restores and names.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbgrader.utils import determine_grade

from autograde import hidden
from kvlab import checks
from kvlab.cache.storage.block_pool import chain_hash
from tests.conftest import LESSONS, REPO, run_autograde

pytestmark = [pytest.mark.notebooks, pytest.mark.slow]

# lesson -> ({answer grade_id: wrong source}, the test cells those mistakes fail)
MISTAKES = {
    "01_bytes_per_step": (
        {
            # Derives head_dim from the width: right for every public model, wrong for the hidden one whose head_dim
            # is set on its own, so only the hidden part of the test fails.
            "kv_bytes_per_token": (
                "def kv_bytes_per_token(cfg, bytes_per_element):\n"
                "    if cfg.mla is not None:\n"
                "        return round(cfg.n_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)"
                " * bytes_per_element)\n"
                "    head_dim = cfg.d_model // cfg.n_heads\n"
                "    return round(2 * cfg.n_layers * cfg.n_kv_heads * head_dim * bytes_per_element)"
            ),
            # Forgets that the weights take part of the time budget.
            "batch_for_tpot": (
                "def batch_for_tpot(target_ms, weight_bytes, kv_bytes_per_token, context, bandwidth_gbps):\n"
                "    return target_ms / 1e3 * bandwidth_gbps * 1e9 / (context * kv_bytes_per_token)"
            ),
        },
        {"check_kv_bytes_per_token", "check_batch_for_tpot"},
    ),
    "03_measuring_tpot": (
        {
            # Divides by every token, the first (prefill) one included.
            "request_metrics": (
                "def request_metrics(token_times_s):\n"
                "    ms = [t * 1e3 for t in token_times_s]\n"
                "    gaps = [b - a for a, b in zip(ms, ms[1:])]\n"
                "    return {'ttft_ms': ms[0], 'tpot_ms': ms[-1] / len(ms), 'itl_ms': gaps, 'e2el_ms': ms[-1]}"
            ),
            # Nearest rank instead of interpolation.
            "percentile": (
                "def percentile(values, p):\n"
                "    ordered = sorted(values)\n"
                "    return ordered[round((len(ordered) - 1) * p / 100)]"
            ),
        },
        {"check_request_metrics", "check_percentile"},
    ),
}


def points(path: Path) -> dict[str, int]:
    nb = nbformat.read(path, as_version=4)
    meta = [c.metadata.get("nbgrader", {}) for c in nb.cells]
    return {m["grade_id"]: m["points"] for m in meta if m.get("grade")}


# partial edits a test cell whose check its answers pass: grading must restore it, name it, and keep the points.
EDITED = ("01_bytes_per_step", "check_tpot_ms")
# The submission times collect records: perfect's given with --time, blank's the files' modification time.
PERFECT_TIME, PERFECT_UTC = "2025-03-01T17:00+01:00", "2025-03-01 16:00:00+00:00"
BLANK_MTIME, BLANK_UTC = 1_700_000_000, "2023-11-14 22:13:20+00:00"  # hand-converted from the epoch


def answered(root: Path, name: str, dest: Path, wrong: dict[str, str] | None = None, edit: str | None = None) -> Path:
    """Lesson ``name`` as a student hands it in: the released notebook with the solution's code in each answer cell
    (or ``wrong``'s, by grade_id), and test cell ``edit`` replaced by ``pass``."""
    solution = nbformat.read(root / "solutions" / name / f"{name}.ipynb", as_version=4)
    answers = {
        c.metadata.nbgrader["grade_id"]: re.sub(r"(?m)^\s*### (BEGIN|END) SOLUTION\n?", "", c.source)
        for c in solution.cells
        if c.metadata.get("nbgrader", {}).get("solution")
    }
    wrong = dict(wrong or {})
    nb = nbformat.read(root / "lessons" / name / f"{name}.ipynb", as_version=4)
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell.source = wrong.pop(grade_id, answers[grade_id])
        elif grade_id is not None and grade_id == edit:
            cell.source = "pass"
    assert not wrong, f"no answer cells {sorted(wrong)} in {name}"
    dest.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest / f"{name}.ipynb")
    return dest / f"{name}.ipynb"


@pytest.fixture(scope="module")
def graded(released_course: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The course graded, and what `autograde` printed. Two grading processes: the 26 notebooks are most of the
    suite's time (tests/test_instructor.py checks that --jobs records what one process does)."""
    root = released_course
    scratch = tmp_path_factory.mktemp("students")
    perfect, blank = [], []
    for name in LESSONS:
        perfect.append(str(answered(root, name, scratch / "perfect")))
        blank.append(scratch / "blank" / f"{name}.ipynb")
        blank[-1].parent.mkdir(exist_ok=True)
        shutil.copyfile(root / "lessons" / name / f"{name}.ipynb", blank[-1])
        os.utime(blank[-1], (BLANK_MTIME, BLANK_MTIME))
    partial = [
        str(answered(root, name, scratch / "partial", wrong, EDITED[1] if name == EDITED[0] else None))
        for name, (wrong, _) in MISTAKES.items()
    ]
    run_autograde(root, "collect", "perfect", *perfect, "--time", PERFECT_TIME)
    run_autograde(root, "collect", "blank", *map(str, blank))
    run_autograde(root, "collect", "partial", *partial)
    result = run_autograde(root, "autograde", "--jobs", "2")
    run_autograde(root, "feedback")
    run_autograde(root, "export")
    return root, result.stdout + result.stderr


def csv_rows(root: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(root / "autograde" / "exports" / "grades.csv", newline="") as f:
        return {(r["assignment"], r["student_id"]): r for r in csv.DictReader(f)}


def test_scores_from_the_exported_csv(graded):
    root, _ = graded
    got = {key: (row["score"], row["max_score"]) for key, row in csv_rows(root).items()}
    for name in LESSONS:
        total = float(sum(points(root / "solutions" / name / f"{name}.ipynb").values()))
        assert got[(name, "perfect")] == (str(total), str(total)), f"{name}: the solution lost points"
        assert got[(name, "blank")] == ("0.0", str(total)), f"{name}: an unanswered lesson earned points"
        if name not in MISTAKES:
            assert got[(name, "partial")] == ("", str(total)), f"{name}: not submitted, so no score, not 0"
    for name, (_, failing) in MISTAKES.items():
        cell_points = points(root / "solutions" / name / f"{name}.ipynb")
        expected = sum(cell_points.values()) - sum(cell_points[g] for g in failing)
        assert float(got[(name, "partial")][0]) == expected, f"{name}: partial score"


def test_perfect_submissions_ran_every_cell_cleanly(graded):
    """Autograde scores test cells only; a learner running the solution would also see any other cell fail."""
    root, _ = graded
    for name in LESSONS:
        nb = nbformat.read(root / "autograde" / "autograded" / "perfect" / name / f"{name}.ipynb", as_version=4)
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            bad = [
                o.get("ename") or o.get("text", "")[-500:]
                for o in cell.outputs
                if o.output_type == "error" or (o.output_type == "stream" and o.name == "stderr")
            ]
            assert not bad, f"{name}, code cell {i}: the solution raised or wrote to stderr: {bad}"


def test_unanswered_lessons_pass_no_test(graded):
    """Every test cell of a released lesson fails until the learner answers: scored as nbgrader scores a cell."""
    root, _ = graded
    for name in LESSONS:
        nb = nbformat.read(root / "autograde" / "autograded" / "blank" / name / f"{name}.ipynb", as_version=4)
        tests = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade") and c.cell_type == "code"]
        passed = [c.metadata.nbgrader["grade_id"] for c in tests if determine_grade(c)[0] != 0]
        assert tests and not passed, f"{name}: the unanswered lesson passes {passed}"


def test_lessons_regenerate_identically(released_course):
    for name in LESSONS:
        fresh = released_course / "lessons" / name / f"{name}.ipynb"
        assert fresh.read_text() == (REPO / "lessons" / name / f"{name}.ipynb").read_text(), (
            f"lessons/{name} differs from a fresh release: run `python -m autograde release`"
        )


def test_timestamps_in_the_csv(graded):
    rows = csv_rows(graded[0])
    for name in LESSONS:
        assert rows[(name, "perfect")]["timestamp"] == PERFECT_UTC
        assert rows[(name, "blank")]["timestamp"] == BLANK_UTC
        assert (rows[(name, "partial")]["timestamp"] != "") == (name in MISTAKES)


def test_autograde_names_the_one_edited_test_cell(graded):
    _, output = graded
    # Every lesson has hidden tests, so nbgrader itself would flag every test cell of every student.
    edits = [line for line in output.splitlines() if "edited" in line]
    assert len(edits) == 1 and edits[0].rsplit(": ", 1)[1] == f"partial {EDITED[0]} ({EDITED[1]})", output
    assert "has changed!" not in output and "without encryption" not in output


def test_grading_happened_in_the_copy(graded):
    assert graded[0] != REPO and (graded[0] / "autograde" / "gradebook.db").exists()


def chained_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Lesson 05's exercise 1 answered right: one chained hash per full block."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


def hidden_expected_values(name: str) -> set[str]:
    """Every expected value lesson ``name``'s hidden checks would print if they revealed it, formatted as they would."""
    source = (REPO / "solutions" / name / f"{name}.ipynb").read_text()
    wrong_answers = {
        "check_request_metrics": lambda *a: {"ttft_ms": -1.0, "tpot_ms": -1.0, "itl_ms": [], "e2el_ms": -1.0},
        "check_fit_tpot": lambda *a: (-1.0, -1.0),
        "check_step_bytes": lambda *a: (-1, -1),
        "check_allocation_waste": lambda *a: (-1.0, -1.0),
        "check_throughput_latency": lambda *a: dict.fromkeys(
            ("output_tokens_per_s", "p50_tpot_ms", "p99_tpot_ms"), -1.0
        ),
        "check_turn_hits": lambda messages, *a: [-1] * len(messages),
        "check_ttft_saved": lambda records: [(-1.0, -1.0)] * len({r["turn"] for r in records}),
        "check_blocks_needed": lambda *a: (-1, -1),
        "check_cascade_bytes": lambda *a: (-1, -1),
        "check_chat_time": lambda *a: (-1.0, -1.0),
        "check_accept_greedy": lambda *a: (-1, -1),
        "check_byte_speedup": lambda *a: (-1.0, -1.0),
        "check_spec_roofline": lambda *a: (-1.0, -1.0),
    }
    # Checks that also take a learner's earlier answer get a right one, so that only the answer checked is wrong.
    earlier_answers = {"check_prefix_hit_tokens": (chained_block_hashes,)}
    values = set()
    for check in set(re.findall(r"hidden\.(check_\w+)\(", source)) & set(hidden.CASES):
        for case in hidden.CASES[check]:
            try:
                wrong = wrong_answers.get(check, lambda *a: -1)
                getattr(checks, check)(wrong, *earlier_answers.get(check, ()), cases=[case], reveal=True)
            except AssertionError as e:
                values.update(re.findall(r"expected (-?[\d.e+-]+) \(", str(e)))
    # Short values (3072, 300.0) also occur in a lesson's own printouts; five significant digits do not by chance.
    return {v for v in values if len(re.sub(r"e.*", "", v).replace(".", "").strip("-0")) >= 5}


def test_feedback_leaks_no_hidden_test_or_expected_value(graded):
    graded, _ = graded
    pages = {
        p: re.sub(r"<style.*?</style>", "", p.read_text(), flags=re.S)
        for p in graded.glob("autograde/feedback/*/*/*.html")
    }
    assert len(pages) == 2 * len(LESSONS) + len(MISTAKES)
    # The mistake in kv_bytes_per_token fails on a hidden model: its message must be there, its answer must not.
    failed_hidden = pages[graded / "autograde/feedback/partial/01_bytes_per_step/01_bytes_per_step.html"]
    assert "hidden-mqa" in failed_hidden
    expected = {name: hidden_expected_values(name) for name in LESSONS}
    assert sum(map(len, expected.values())) > 15
    for path, html in pages.items():
        assert "HIDDEN TESTS" not in html and "hidden.check_" not in html, f"{path}: hidden test code shown"
        for value in expected[path.parent.name]:
            assert not re.search(rf"(?<![\w.]){re.escape(value)}(?![\w.])", html), f"{path}: shows {value}"
