"""benchmarks/measured_checks.py, the false-failure loop: every measured check it names is a graded cell of its
lesson with a measurement cell (retake) above it, and every lesson check that prints a reading is in its list."""

from __future__ import annotations

import importlib.util
import sys

import nbformat

from tests.conftest import REPO


def loop_module():
    spec = importlib.util.spec_from_file_location("measured_checks", REPO / "benchmarks" / "measured_checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_measured_check_has_a_retake_cell_above_it():
    loop = loop_module()
    for lesson, grade_ids in loop.MEASURED.items():
        nb = nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4)
        for grade_id, span in loop.spans(nb, grade_ids).items():
            assert "retake(" in nb.cells[span.start].source, (lesson, grade_id)
            assert nb.cells[span.stop - 1].metadata["nbgrader"]["grade_id"] == grade_id


def test_every_retake_cell_of_lessons_03_to_07_is_looped():
    loop = loop_module()
    for lesson in loop.MEASURED:
        nb = nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4)
        starts = {span.start for span in loop.spans(nb, loop.MEASURED[lesson]).values()}
        retakes = {i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "retake(" in c.source}
        assert retakes <= starts, (lesson, sorted(retakes - starts))
