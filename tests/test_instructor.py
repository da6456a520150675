"""The instructor's commands on a one-exercise synthetic lesson in a temporary course: release is all or nothing,
nothing needs an activated environment, autograde names only the test cells a student edited, and export tells a
missing submission from a zero. (tests/test_grading.py grades the real lessons; tests/test_instructor_collect.py
covers collect.)"""

from __future__ import annotations

import csv
import os
import re
import shutil
import sqlite3
import sys
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from tests.conftest import BARE_ENV, course_copy, run_autograde

pytestmark = [pytest.mark.notebooks, pytest.mark.slow]

TINY = "00_tiny"
ANSWER = "def answer():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION"
# The hidden part makes the gradebook's copy of this cell differ from the released one, as in every real lesson.
CHECK_ANSWER = (
    "assert answer() == 42, 'answer() should return 42'\n"
    "### BEGIN HIDDEN TESTS\n"
    "assert answer() * 2 == 84\n"
    "### END HIDDEN TESTS"
)
# The kernel nbgrader starts must be this environment's interpreter (the system one has no torch), and it must find
# this environment's tools first on PATH, whatever PATH the instructor had.
CHECK_KERNEL = (
    "import os, sys\n"
    f"assert sys.prefix == {sys.prefix!r}, sys.prefix\n"
    f"assert os.environ['PATH'].split(os.pathsep)[0] == {os.path.dirname(sys.executable)!r}, os.environ['PATH']\n"
    "import torch"
)
POINTS = {"check_answer": 2, "check_kernel": 1}
DELETE = "(this cell is deleted)"
RIGHT, WRONG = "def answer():\n    return 42", "def answer():\n    return 41"


def cell(source: str, grade_id: str, points: int = 0, solution: bool = False) -> nbformat.NotebookNode:
    meta = {
        "grade": bool(points),
        "grade_id": grade_id,
        "locked": not solution,
        "schema_version": 3,
        "solution": solution,
        "task": False,
    }
    if points:
        meta["points"] = points
    return nbformat.v4.new_code_cell(source, metadata={"nbgrader": meta})


def tiny_solution(*extra: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        cell(ANSWER, "answer", solution=True),
        cell(CHECK_ANSWER, "check_answer", POINTS["check_answer"]),
        cell(CHECK_KERNEL, "check_kernel", POINTS["check_kernel"]),
        *extra,
    ]
    return nb


def write_solution(root: Path, nb: nbformat.NotebookNode) -> None:
    path = root / "solutions" / TINY / f"{TINY}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def tiny_course(root: Path) -> Path:
    course_copy(root, lessons=[])
    write_solution(root, tiny_solution())
    return root


def student_copy(root: Path, dest: Path, answer: str, check_answer: str | None = None) -> Path:
    """The released lesson, ``answer`` in its answer cell and, if given, ``check_answer`` in its test cell (which
    ``DELETE`` deletes)."""
    nb = nbformat.read(root / "lessons" / TINY / f"{TINY}.ipynb", as_version=4)
    for c in nb.cells:
        grade_id = c.metadata.nbgrader["grade_id"]
        if grade_id == "answer":
            c.source = answer
        elif grade_id == "check_answer" and check_answer is not None:
            c.source = check_answer
    nb.cells = [c for c in nb.cells if c.source != DELETE]
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return dest


def gradebook(root: Path) -> Gradebook:
    return Gradebook(f"sqlite:///{root / 'autograde' / 'gradebook.db'}", course_id="kvlab")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under lessons/, and the gradebook, by path."""
    files = [p for p in (root / "lessons").rglob("*") if p.is_file()] + [root / "autograde" / "gradebook.db"]
    return {str(p.relative_to(root)): p.read_bytes() for p in files if p.exists()}


def rows(root: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(root / "autograde" / "exports" / "grades.csv", newline="") as f:
        return {(r["assignment"], r["student_id"]): r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The tiny course released and graded, with PATH cut to the system's: "good" answers right in a file named as
    a browser names a second download; "tamper" answers wrong and edits the test cell to pass anyway; "deleter"
    answers right and deletes the test cell; "absent" is on the roster and submits nothing."""
    root = tiny_course(tmp_path_factory.mktemp("tiny"))
    run_autograde(root, "release", env=BARE_ENV)
    scratch = tmp_path_factory.mktemp("students")
    roster = scratch / "roster.csv"
    roster.write_text(
        "id,first_name,last_name,email\ngood,,,\ntamper,,,\ndeleter,,,\nabsent,Ada,Absent,ada@example.org\n"
    )
    run_autograde(root, "roster", str(roster))
    good = student_copy(root, scratch / f"{TINY} (1).ipynb", RIGHT)
    tamper = student_copy(root, scratch / "tamper" / f"{TINY}.ipynb", WRONG, "pass")
    deleter = student_copy(root, scratch / "deleter" / f"{TINY}.ipynb", RIGHT, DELETE)
    for student, file in (("good", good), ("tamper", tamper), ("deleter", deleter)):
        run_autograde(root, "collect", student, str(file))
    result = run_autograde(root, "autograde", env=BARE_ENV)
    run_autograde(root, "export")
    return root, result.stdout + result.stderr


@pytest.fixture
def graded_copy(graded, tmp_path) -> Path:
    """A copy of the graded course that a test may change."""
    shutil.copytree(graded[0], tmp_path / "course")
    return tmp_path / "course"


def test_first_release_without_an_activated_environment(tmp_path):
    """A failed first release leaves no half-made gradebook; a good one, with only the system's PATH, makes one.

    nbgrader runs ``alembic`` from PATH to create a gradebook; unless the system has its own alembic, that fails
    without the interpreter's bin/ put first on PATH."""
    root = tiny_course(tmp_path)
    # Two cells with one grade_id: nbgrader fails after it has created the gradebook.
    write_solution(root, tiny_solution(cell("pass", "check_answer", 1)))
    failed = run_autograde(root, "release", env=BARE_ENV, check=False)
    assert failed.returncode == 1 and "Traceback" not in failed.stdout
    assert f"nbgrader failed on {TINY}" in failed.stderr
    assert not (root / "autograde" / "gradebook.db").exists() and not (root / "lessons").exists()

    write_solution(root, tiny_solution())
    run_autograde(root, "release", env=BARE_ENV)
    assert (root / "lessons" / TINY / f"{TINY}.ipynb").is_file()
    with sqlite3.connect(root / "autograde" / "gradebook.db") as db:
        assert db.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)

    nothing = run_autograde(root, "export", check=False)
    assert nothing.returncode == 1 and "nothing graded yet" in nothing.stderr
    assert not (root / "autograde" / "exports" / "grades.csv").exists()


def test_export_before_any_release_is_refused(tmp_path):
    root = course_copy(tmp_path, lessons=[])
    result = run_autograde(root, "export", check=False)
    assert result.returncode == 1 and "release" in result.stderr and "Traceback" not in result.stderr
    assert not (root / "autograde" / "exports").exists()


def test_scores_missing_and_timestamps_in_the_csv(graded):
    root, _ = graded
    got = rows(root)
    assert set(got) == {(TINY, "good"), (TINY, "tamper"), (TINY, "deleter"), (TINY, "absent")}
    assert float(got[(TINY, "good")]["score"]) == sum(POINTS.values())
    # The edited test cell is graded with its released text, which fails on 41.
    assert float(got[(TINY, "tamper")]["score"]) == POINTS["check_kernel"]
    # The deleted test cell is put back and graded: the right answer keeps its points.
    assert float(got[(TINY, "deleter")]["score"]) == sum(POINTS.values())
    for student in ("good", "tamper", "deleter"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\+00:00", got[(TINY, student)]["timestamp"])
    absent = got[(TINY, "absent")]
    assert (absent["timestamp"], absent["score"], absent["raw_score"]) == ("", "", "")
    assert (absent["first_name"], absent["last_name"], absent["email"]) == ("Ada", "Absent", "ada@example.org")


def test_autograde_names_only_the_test_cells_a_student_edited(graded):
    _, output = graded
    edits = [line for line in output.splitlines() if "edited" in line]
    expected = f"deleter {TINY} (check_answer); tamper {TINY} (check_answer)"
    assert len(edits) == 1 and edits[0].rsplit(": ", 1)[1] == expected, output
    for noise in ("has changed!", "Removing existing", "without encryption", "Traceback"):
        assert noise not in output, output


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("name\nalice\n", "needs `id`"),
        ("id,nickname\nalice,al\n", "may have first_name"),
        ("id\n../etc\n", "line 2"),
    ],
)
def test_a_bad_roster_is_refused_naming_what_is_wrong(graded_copy, tmp_path, text, says):
    before = snapshot(graded_copy)
    (tmp_path / "roster.csv").write_text(text)
    result = run_autograde(graded_copy, "roster", str(tmp_path / "roster.csv"), check=False)
    assert result.returncode == 1 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert snapshot(graded_copy) == before


def edited_line(output: str) -> str:
    edits = [line for line in output.splitlines() if "edited" in line]
    return edits[0] if edits else ""


def test_a_test_edited_and_released_after_students_fetched_is_no_edit_of_theirs(graded_copy, tmp_path):
    """The README's "edit a test, release, regrade": each submission is compared with the release its student
    could have fetched (by submission time), so the earlier students are not named, and grading uses the new test."""
    root = graded_copy
    source = root / "solutions" / TINY / f"{TINY}.ipynb"
    nb = nbformat.read(source, as_version=4)
    [test] = [c for c in nb.cells if c.metadata.nbgrader["grade_id"] == "check_answer"]
    test.source = test.source.replace("\n", "\n# a comment the instructor added\n", 1)
    nbformat.write(nb, source)
    assert "released" in run_autograde(root, "release").stdout
    late = student_copy(root, tmp_path / f"{TINY}.ipynb", RIGHT)  # fetched the new release
    run_autograde(root, "collect", "late", str(late))
    output = run_autograde(root, "autograde").stdout
    assert edited_line(output).rsplit(": ", 1)[1] == f"deleter {TINY} (check_answer); tamper {TINY} (check_answer)"
    graded = nbformat.read(root / "autograde" / "autograded" / "good" / TINY / f"{TINY}.ipynb", as_version=4)
    assert any("a comment the instructor added" in c.source for c in graded.cells)


def test_export_refuses_a_grade_older_than_the_submission(graded_copy, tmp_path):
    root = graded_copy
    export = root / "autograde" / "exports" / "grades.csv"
    before = export.read_bytes()
    again = student_copy(root, tmp_path / f"{TINY}.ipynb", WRONG)
    run_autograde(root, "collect", "good", str(again), "--time", "2031-01-02T03:04Z")
    refused = run_autograde(root, "export", check=False)
    assert refused.returncode == 1 and f"good {TINY}" in refused.stderr and "tamper" not in refused.stderr
    assert export.read_bytes() == before
    run_autograde(root, "autograde", "--student", "good")
    run_autograde(root, "export")
    assert rows(root)[(TINY, "good")]["timestamp"] == "2031-01-02 03:04:00+00:00"
    assert float(rows(root)[(TINY, "good")]["score"]) == POINTS["check_kernel"]


def test_parallel_grading_records_what_one_process_does(graded, graded_copy):
    """Three submissions graded by two nbgrader processes at once, each into its own gradebook copy, then merged:
    the export is the one sequential grading gave, and the course's gradebook is intact."""
    root = graded_copy
    (root / "autograde" / "exports" / "grades.csv").unlink()
    output = run_autograde(root, "autograde", "--jobs", "2").stdout
    run_autograde(root, "export")
    assert rows(root) == rows(graded[0])
    assert edited_line(output) == edited_line(graded[1])
    assert "Warning" not in output
    with sqlite3.connect(root / "autograde" / "gradebook.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT count(*) FROM submitted_assignment").fetchone() == (3,)
    assert not [p for p in (root / "autograde").iterdir() if p.name.startswith("tmp")]


def test_validate_reports_an_edited_test_cell_and_the_check_it_then_fails(graded, tmp_path):
    root, _ = graded
    notebook = student_copy(root, tmp_path / "Untitled.ipynb", "def answer():\n    return 41", "pass")
    result = run_autograde(root, "validate", str(notebook), env=BARE_ENV, check=False)
    assert result.returncode == 1
    assert re.search(r"edited.*: check_answer$", result.stdout, re.M), result.stdout
    assert "failed: assert answer() == 42" in result.stdout and "answer() should return 42" in result.stdout
    assert "check_kernel" not in result.stdout and "import os, sys" not in result.stdout, result.stdout


def test_failed_release_changes_nothing(graded_copy):
    root = graded_copy
    before = snapshot(root)
    write_solution(root, tiny_solution(cell("pass", "check_answer", 1)))
    result = run_autograde(root, "release", check=False)
    assert result.returncode == 1 and "lessons/ and the gradebook are as they were" in result.stderr
    assert snapshot(root) == before


def test_unchanged_rerelease_with_submissions_succeeds(graded_copy):
    before = snapshot(graded_copy)
    result = run_autograde(graded_copy, "release")
    assert f"lessons/{TINY}: unchanged" in result.stdout
    assert {k: v for k, v in snapshot(graded_copy).items() if k.startswith("lessons")} == {
        k: v for k, v in before.items() if k.startswith("lessons")
    }


# nbgrader's own Gradebook.add_submission trips an SQLAlchemy 2 autoflush warning; the submission is recorded.
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")
def test_refused_rerelease_says_what_to_do_and_that_keeps_other_grades(graded_copy):
    root = graded_copy
    with gradebook(root) as gb:  # another lesson's grade, which the fix must keep
        gb.add_assignment("01_other")
        gb.add_submission("01_other", "good")
    before = snapshot(root)
    write_solution(root, tiny_solution(cell("assert True", "check_new", 1)))
    refused = run_autograde(root, "release", check=False)
    assert refused.returncode == 1 and snapshot(root) == before
    assert "Traceback" not in refused.stderr and 'File "' not in refused.stderr, refused.stderr
    commands = re.findall(r"^    (python -m autograde .*)$", refused.stderr, re.M)
    assert commands and "--drop-grades" in commands[0], refused.stderr
    released = run_autograde(root, *commands[0].split()[3:])
    assert "dropped the grades of 3 submission(s)" in released.stdout
    lesson = nbformat.read(root / "lessons" / TINY / f"{TINY}.ipynb", as_version=4)
    assert "check_new" in {c.metadata.nbgrader["grade_id"] for c in lesson.cells}
    assert not list((root / "autograde" / "autograded").glob(f"*/{TINY}"))
    assert (root / "autograde" / "submitted" / "good" / TINY / f"{TINY}.ipynb").is_file()
    with gradebook(root) as gb:
        assert [s.student.id for s in gb.find_assignment("01_other").submissions] == ["good"]
        assert gb.find_assignment(TINY).submissions == []


def test_a_timed_out_cell_is_logged_with_its_student(graded_copy, tmp_path):
    root = graded_copy
    with open(root / "autograde" / "nbgrader_config.py", "a") as f:
        f.write("\nc.Execute.timeout = 2\n")
    slow = student_copy(root, tmp_path / f"{TINY}.ipynb", "def answer():\n    import time\n    time.sleep(60)")
    run_autograde(root, "collect", "slow", str(slow))
    result = run_autograde(root, "autograde", "--student", "slow", check=False)
    errors = [line for line in result.stderr.splitlines() if "| ERROR]" in line]
    assert errors and all("slow" in line for line in errors), result.stderr
