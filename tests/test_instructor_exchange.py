"""The instructor's commands through nbgrader's exchange, on the one-exercise test lesson: `release --exchange`,
students fetching and submitting with nbgrader's own commands (as their JupyterLab's assignment list does), then
`collect --from-exchange`, `autograde`, `feedback --exchange`, `export`, and the students fetching their feedback.
Every student here runs as this one Unix user, as under a hub's SimpleLocalProcessSpawner."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.conftest import run_autograde
from tests.test_instructor import POINTS, RIGHT, TINY, WRONG, rows, tiny_course

pytestmark = [pytest.mark.notebooks, pytest.mark.slow]


def student(home: Path, *args: str) -> subprocess.CompletedProcess:
    """nbgrader's student-side command ``args`` in ``home`` (the student's server's folder), as student ``home.name``.

    Under one Unix user nbgrader would name every submission after that user; ``student_id`` is what a hub's
    student config sets from JUPYTERHUB_USER."""
    exchange = home.parent.parent / "exchange"
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--Exchange.root={exchange}"]
    cmd += ["--CourseDirectory.course_id=kvlab", f"--CourseDirectory.student_id={home.name}"]
    result = subprocess.run(cmd, cwd=home, capture_output=True, text=True, env={**os.environ, "HOME": str(home)})
    assert result.returncode == 0, result.stderr
    return result


def answer_and_submit(home: Path, answer: str) -> None:
    path = home / TINY / f"{TINY}.ipynb"
    nb = nbformat.read(path, as_version=4)
    [cell] = [c for c in nb.cells if c.metadata.nbgrader["grade_id"] == "answer"]
    cell.source = answer
    nbformat.write(nb, path)
    student(home, "submit", TINY)


def test_release_collect_grade_and_return_feedback_through_the_exchange(tmp_path):
    root = tiny_course(tmp_path / "course")
    exchange = tmp_path / "exchange"
    env = {**os.environ, "KVLAB_EXCHANGE": str(exchange)}  # the variable instead of --exchange
    run_autograde(root, "release", "--exchange", str(exchange))
    assert (exchange / "kvlab" / "outbound" / TINY / f"{TINY}.ipynb").is_file()
    (tmp_path / "roster.csv").write_text("id\nalice\nbob\ncarol\n")
    run_autograde(root, "roster", str(tmp_path / "roster.csv"))

    homes = {name: tmp_path / "home" / name for name in ("alice", "bob")}
    for home in homes.values():
        home.mkdir(parents=True)
        student(home, "fetch_assignment", TINY)
    answer_and_submit(homes["alice"], WRONG)
    answer_and_submit(homes["alice"], RIGHT)  # a second submission: the latest one counts
    answer_and_submit(homes["bob"], WRONG)

    collected = run_autograde(root, "collect", "--from-exchange", env=env)
    assert "cheating" not in collected.stderr and "2 submission(s)" in collected.stdout, collected
    inbound = sorted((exchange / "kvlab" / "inbound").glob(f"alice+{TINY}+*"))
    assert len(inbound) == 2
    stamp = (root / "autograde" / "submitted" / "alice" / TINY / "timestamp.txt").read_text()
    assert stamp == (inbound[-1] / "timestamp.txt").read_text()  # nbgrader's own time of the latest

    run_autograde(root, "autograde")
    feedback = run_autograde(root, "feedback", env=env)
    assert "display_data_priority" not in feedback.stderr, feedback.stderr
    run_autograde(root, "export")
    got = rows(root)
    assert float(got[(TINY, "alice")]["score"]) == sum(POINTS.values())
    assert float(got[(TINY, "bob")]["score"]) == POINTS["check_kernel"]
    assert got[(TINY, "carol")]["score"] == "" and got[(TINY, "carol")]["timestamp"] == ""

    for home, answer in ((homes["alice"], "return 42"), (homes["bob"], "return 41")):
        student(home, "fetch_feedback", TINY)
        [page] = (home / TINY / "feedback").glob(f"*/{TINY}.html")  # the feedback on their own latest submission
        text = re.sub(r"<[^>]+>", "", page.read_text())  # the code is highlighted: a tag around each token
        assert answer in text and "HIDDEN TESTS" not in text
