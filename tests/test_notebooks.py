"""The course notebooks: solutions/ is their source; nbgrader releases them; they run and their tests check.

tests/test_grading.py releases, runs and grades every lesson, answered and unanswered, once for the whole suite."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nbformat
import pytest

from tests.conftest import GRADING_FILES, LESSONS, REPO, run_autograde


def notebook(kind: str, name: str, root: Path = REPO) -> Path:
    return root / kind / name / f"{name}.ipynb"


@pytest.mark.parametrize("kind", ["solutions", "lessons"])
def test_committed_notebooks_have_no_outputs(kind):
    for name in LESSONS:
        nb = nbformat.read(notebook(kind, name), as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{kind}/{name}: outputs committed"


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_structure(name):
    """At least four graded exercises, each test cell worth points, every answer a stub in the release."""
    nb = nbformat.read(notebook("lessons", name), as_version=4)
    meta = [c.metadata.get("nbgrader", {}) for c in nb.cells]
    tests = [m for m in meta if m.get("grade")]
    answers = [c for c, m in zip(nb.cells, meta, strict=True) if m.get("solution")]
    assert len(tests) >= 4 and all(m["points"] > 0 for m in tests)
    assert len(answers) >= 4
    for cell in answers:
        assert "raise NotImplementedError()" in cell.source and "BEGIN SOLUTION" not in cell.source
    assert not any("HIDDEN TESTS" in c.source for c in nb.cells)


def test_clean_deletes_the_gradebook_and_grading_files(tmp_path):
    shutil.copytree(REPO / "autograde", tmp_path / "autograde", ignore=shutil.ignore_patterns(*GRADING_FILES))
    made = [tmp_path / "autograde" / "gradebook.db", tmp_path / "autograde" / "submitted" / "s" / "01" / "x.ipynb"]
    for path in made:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    run_autograde(tmp_path, "clean")
    assert not any(p.exists() for p in made) and (tmp_path / "autograde" / "hidden.py").exists()


APPENDIX = sorted(p.name for p in (REPO / "appendix").glob("*.ipynb"))


@pytest.mark.notebooks
@pytest.mark.parametrize("name", APPENDIX)
@pytest.mark.slow
def test_appendix_runs_in_quick_mode(name, tmp_path, monkeypatch):
    """The appendix notebooks (not graded) run cleanly in quick mode: the serving one starts kvlab serve, measures it
    through the API and stops it; the GPU one runs benchmarks/gpu_check.py's dry run where no GPU run is recorded."""
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "appendix" / name, as_version=4)
    assert all(c.outputs == [] for c in nb.cells if c.cell_type == "code"), f"appendix/{name}: outputs committed"
    monkeypatch.setenv("KVLAB_QUICK", "1")  # the kernel inherits it
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        assert not [o for o in cell.outputs if o.output_type == "error" or o.get("name") == "stderr"], cell.source[:80]


@pytest.mark.notebooks
@pytest.mark.slow
def test_lesson_02_runs_on_the_kernels_an_avx2_only_laptop_runs(tmp_path, monkeypatch):
    """Lesson 02's weight precisions on the kernels of a CPU with AVX2 and no AVX-512 (most learners' laptops):
    every cell runs cleanly, fp16 on fbgemm and bf16 on the cast path. On a CPU with more, the kernels are capped.
    The solution runs as is, so its hidden tests (which import autograde) run too."""
    from nbclient import NotebookClient

    from kvlab.machine.isa import capped_environ

    try:
        capped = capped_environ("avx2", {})
    except ValueError as e:  # not x86, or no AVX2: this CPU runs other kernels anyway
        pytest.skip(str(e))
    for name, value in [*capped.items(), ("KVLAB_QUICK", "1")]:
        monkeypatch.setenv(name, value)  # the kernel inherits them
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(notebook("solutions", "02_roofline"), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = ""
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        assert not [o for o in cell.outputs if o.output_type == "error" or o.get("name") == "stderr"], cell.source[:80]
        printed += "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    assert "CPU capability AVX2" in printed
    rows = {words[0]: words[1] for words in map(str.split, printed.splitlines()) if words[:1] in (["bf16"], ["fp16"])}
    assert rows == {"bf16": "cast", "fp16": "fbgemm-fp16"}, printed[-2000:]
