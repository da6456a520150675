"""benchmarks/measured_checks.py, the false-failure loop: every measured check it names is a graded cell of its
lesson with a measurement cell (retake, or the timing cell START names) above it, and every lesson check that
prints a reading is in its list."""

from __future__ import annotations

import nbformat

from tests.conftest import REPO
from tests.helpers import benchmark_module


def loop_module():
    return benchmark_module("measured_checks")


def test_every_measured_check_has_a_retake_cell_above_it():
    loop = loop_module()
    for lesson, grade_ids in loop.MEASURED.items():
        nb = nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4)
        for grade_id, span in loop.spans(nb, grade_ids).items():
            assert loop.START.get(grade_id, "retake(") in nb.cells[span.start].source, (lesson, grade_id)
            assert nb.cells[span.stop - 1].metadata["nbgrader"]["grade_id"] == grade_id


def test_every_retake_cell_of_the_looped_lessons_is_looped():
    loop = loop_module()
    for lesson in loop.MEASURED:
        nb = nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4)
        starts = {span.start for span in loop.spans(nb, loop.MEASURED[lesson]).values()}
        retakes = {i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "retake(" in c.source}
        assert retakes <= starts, (lesson, sorted(retakes - starts))
