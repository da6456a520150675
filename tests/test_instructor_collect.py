"""``collect`` on a temporary course copy: the names students' tools give a notebook, one clean error per bad file
with the others still collected, nbgrader's timestamp.txt, and a word when a submission replaces an earlier one.

``collect`` runs in this process (it starts no nbgrader), except where the process itself is under test: an
instructor's bare PATH, and what a fresh interpreter imports."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nbgrader.coursedir import CourseDirectory

from autograde.cli import main
from tests.conftest import BARE_ENV, REPO, course_copy, run_autograde

ONE, THREE = "01_bytes_per_step", "03_measuring_tpot"


@pytest.fixture
def course(tmp_path) -> Path:
    return course_copy(tmp_path / "course", lessons=[ONE, THREE], released=True)


def collect(capsys: pytest.CaptureFixture[str], course: Path, *args: str, check: bool = True):
    """``autograde collect *args`` on ``course`` in this process, ended as the command line ends: a SystemExit's
    message goes to stderr with status 1; any other exception (a traceback, on the command line) fails the test.
    Returns what ``run_autograde`` does (status, stdout, stderr)."""
    try:
        code = main(["--root", str(course), "collect", *args])
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = 1 if isinstance(e.code, str) else e.code or 0
    out, err = capsys.readouterr()
    if check and code:
        pytest.fail(f"autograde collect {' '.join(args)} exited {code}:\n{out}\n{err}")
    return subprocess.CompletedProcess(["autograde", "collect", *args], code, out, err)


def download(tmp_path: Path, lesson: str, name: str, mtime: float | None = None) -> Path:
    """The released ``lesson`` saved as ``name``, as a student's browser or Jupyter would name it."""
    path = tmp_path / "downloads" / name
    path.parent.mkdir(exist_ok=True)
    shutil.copyfile(REPO / "lessons" / lesson / f"{lesson}.ipynb", path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def submitted_files(root: Path) -> set[str]:
    base = root / "autograde" / "submitted"
    return {str(p.relative_to(base)) for p in base.rglob("*")} if base.exists() else set()


def test_browser_and_jupyter_names_are_collected(course, tmp_path):
    """As a process on the system's PATH only: collect needs nothing of an activated environment."""
    files = [download(tmp_path, ONE, f"{ONE} (1).ipynb"), download(tmp_path, THREE, f"{THREE}-Copy1.ipynb")]
    result = run_autograde(course, "collect", "alice", *map(str, files), env=BARE_ENV)
    assert result.stderr == ""
    for lesson, file in zip([ONE, THREE], files, strict=True):
        dest = course / "autograde" / "submitted" / "alice" / lesson / f"{lesson}.ipynb"
        assert dest.read_bytes() == file.read_bytes()


def test_untitled_needs_the_lesson_named(course, tmp_path, capsys):
    file = download(tmp_path, ONE, "Untitled1.ipynb")
    refused = collect(capsys, course, "bob", str(file), check=False)
    assert refused.returncode == 1 and "--lesson" in refused.stderr
    assert submitted_files(course) == set()
    collect(capsys, course, "bob", str(file), "--lesson", ONE)
    assert submitted_files(course) == {"bob", f"bob/{ONE}", f"bob/{ONE}/{ONE}.ipynb", f"bob/{ONE}/timestamp.txt"}


def test_each_bad_file_gets_one_line_and_the_others_are_collected(course, tmp_path, capsys):
    good = download(tmp_path, THREE, f"{THREE}.ipynb")
    broken = tmp_path / "downloads" / f"{ONE}.ipynb"
    broken.write_text("<html>a login page, saved as a notebook</html>")
    missing = tmp_path / "downloads" / f"{ONE} (2).ipynb"
    result = collect(capsys, course, "dave", str(missing), str(broken), str(good), check=False)
    assert result.returncode == 1
    errors = result.stderr.splitlines()
    assert len(errors) == 2, result.stderr
    assert str(missing) in errors[0] and "no such file" in errors[0]
    assert str(broken) in errors[1] and "not a readable notebook" in errors[1]
    # No folder for the lesson that was not collected: an empty one would make autograde look for it.
    assert submitted_files(course) == {
        "dave",
        f"dave/{THREE}",
        f"dave/{THREE}/{THREE}.ipynb",
        f"dave/{THREE}/timestamp.txt",
    }


def test_two_files_for_one_lesson_in_one_command(course, tmp_path, capsys):
    first, second = download(tmp_path, ONE, f"{ONE}.ipynb"), download(tmp_path, ONE, f"{ONE} (1).ipynb")
    result = collect(capsys, course, "erin", str(first), str(second), check=False)
    assert result.returncode == 1 and str(second) in result.stderr and str(first) in result.stderr
    assert (course / "autograde" / "submitted" / "erin" / ONE / f"{ONE}.ipynb").read_bytes() == first.read_bytes()


def test_timestamps_as_nbgrader_reads_them_and_replacement_is_reported(course, tmp_path, capsys):
    folder = course / "autograde" / "submitted" / "carol" / ONE
    # 1_700_000_000 s after the epoch is 2023-11-14 22:13:20 UTC.
    file = download(tmp_path, ONE, f"carol_{ONE}.ipynb", mtime=1_700_000_000)
    first = collect(capsys, course, "carol", str(file))
    assert "replaces" not in first.stdout
    assert CourseDirectory().get_existing_timestamp(str(folder)) == datetime.datetime(2023, 11, 14, 22, 13, 20)

    again = collect(capsys, course, "carol", str(file), "--time", "2025-03-01T17:00+01:00")
    assert "replaces the earlier submission" in again.stdout and "2023-11-14 22:13:20" in again.stdout
    assert CourseDirectory().get_existing_timestamp(str(folder)) == datetime.datetime(2025, 3, 1, 16, 0)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["../etc", "FILE"], "student"),
        (["frank", "FILE", "--lesson", "99_nope"], "99_nope"),
        (["frank", "FILE", "--time", "yesterday-ish"], "--time"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(course, tmp_path, args, says, capsys):
    file = str(download(tmp_path, ONE, f"{ONE}.ipynb"))
    result = collect(capsys, course, *(file if a == "FILE" else a for a in args), check=False)
    assert result.returncode != 0 and says in result.stderr
    assert submitted_files(course) == set()


def test_another_lessons_notebook_is_refused_naming_both(course, tmp_path, capsys):
    """Every lesson has a setup cell with the same grade_id; the lesson's own graded cells tell them apart."""
    file = download(tmp_path, ONE, f"{ONE}.ipynb")
    result = collect(capsys, course, "erin", str(file), "--lesson", THREE, check=False)
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert ONE in line.split(str(file), 1)[1] and THREE in line, line
    assert submitted_files(course) == set()


def test_help_and_collect_pay_no_unused_import(course, tmp_path):
    """--help imports nothing of nbgrader's; nbgrader's runs skip the grammar jsonschema would compile (lean.py)."""
    for args in (["--help"], ["collect", "ann", str(download(tmp_path, ONE, f"{ONE}.ipynb"))]):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "autograde", "--root", str(course), *args],
            cwd=course,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
        # The module that compiles the grammar (an import refused at once still gets an importtime line).
        assert "rfc3987_syntax.syntax_helpers" not in imported
        if args == ["--help"]:
            assert not {m for m in imported if m.split(".")[0] in ("nbgrader", "nbformat", "sqlalchemy")}
