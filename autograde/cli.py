"""``python -m autograde <command>``: the course's instructor commands, all headless (see README.md).

    release [LESSON ...] [--drop-grades]   lessons/ from solutions/ (nbgrader generate_assignment), all or nothing
    validate NOTEBOOK ... [--invert] [--all-cells]
    collect STUDENT FILE ... [--lesson NAME] [--time WHEN]
                                           copy a student's notebooks into autograde/submitted/
    autograde [LESSON ...] [--student ID]  run every submission in quick mode and record its scores
    feedback [LESSON ...]                  HTML feedback per submission, hidden tests removed
    export [--to CSV]                      all scores as CSV (default autograde/exports/grades.csv)
    clean                                  delete the gradebook and every submitted, graded and exported file

Every command acts on the course that holds this package (``--root`` picks another copy), so a test can grade a
temporary copy without touching the repository's gradebook.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import datetime
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from autograde import COURSE_ROOT

GRADING_DIRS = ("submitted", "autograded", "feedback", "exports")
# nbgrader's own format for timestamp.txt (nbgrader.exchange.abc.Exchange.timestamp_format), always in UTC.
TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%S.%f %Z"
STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")

# nbgrader log lines that say nothing an instructor can act on:
# - "Attribute ... has changed!": nbgrader compares a submitted locked cell with its source *including* the hidden
#   tests a student never sees, so it fires for every untouched test cell with hidden tests. `autograde` reports
#   the cells students really edited, against the released lesson, in one line instead (edited_locked_cells).
# - "Removing existing assignment": `autograde` and `feedback` regrade from scratch on purpose (--force).
# - nbconvert's "Alternative text is missing on N image(s)" in feedback: the images are the lessons' own plots.
NOISE = re.compile(
    r"Attribute '\w+' for cell .* has changed!"
    r"|Removing existing (assignment|notebook): "
    r"|Alternative text is missing on \d+ image"
)
# How nbgrader says it refused a re-release (SaveCells, GenerateAssignment._clean_old_notebooks), and that a lesson
# failed; each captures the lesson's name (one notebook per lesson, named as the lesson).
REFUSED = re.compile(r"Cannot add or remove cells for notebook '([^']+)'")
REFUSED_ASSIGNMENT = re.compile(r"Cannot modify existing assignment 'Assignment<([^>]+)>'")
FAILED = re.compile(r"error processing assignment '([^']+)'")


def lesson_names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())


def checked_lessons(root: Path, names: Sequence[str], known: Sequence[str] | None = None) -> list[str]:
    """``names`` if each is a lesson of the course (``known``, default every lesson in solutions/), else exit."""
    known = lesson_names(root) if known is None else known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"autograde: no lesson {', '.join(unknown)}; lessons: {', '.join(known) or '(none)'}")
    return list(names)


def tool_dirs() -> list[str]:
    """Where the running interpreter's console scripts live (alembic, jupyter): bin/ beside it, or Scripts/."""
    dirs = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    return list(dict.fromkeys(d for d in dirs if d))


def kernel_env(root: Path) -> dict[str, str]:
    """The environment nbgrader and its kernels run in.

    - PATH: nbgrader runs ``alembic`` from PATH when it creates a gradebook, and an environment the instructor did
      not activate is not on PATH; so this interpreter's own script folder goes first. (jupyter_client starts a
      kernel spec's ``python`` as this interpreter already.)
    - PYTHONPATH: hidden test cells ``import autograde.hidden`` from a notebook in a student's folder.
    - PYTHONWARNINGS, TQDM_DISABLE: nbgrader zeroes a test cell that writes to stderr; warnings raised while
      modules import (before a lesson's setup cell filters them) and progress bars would.
    - MPLBACKEND: plots go into the notebook, never to a window.
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([*tool_dirs(), *(p for p in env.get("PATH", "").split(os.pathsep) if p)])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONWARNINGS="ignore", TQDM_DISABLE="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
    return env


def nbgrader(root: Path, *args: str, check: bool = True) -> tuple[int, str]:
    """Run one nbgrader command on the course at ``root`` with its config.

    nbgrader's log (stderr) is passed through as it comes, less the lines ``NOISE`` matches. Returns the exit
    status and the whole log; with ``check``, exits with a message if nbgrader failed.
    """
    # JupyterApp appends ".py" to the config file's name itself.
    config = root / "autograde" / "nbgrader_config"
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--JupyterApp.config_file={config}"]
    log = []
    with subprocess.Popen(cmd, cwd=root, env=kernel_env(root), stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:
            log.append(line)
            if not NOISE.search(line):
                sys.stderr.write(line)
    if check and proc.returncode:
        raise SystemExit(f"autograde: nbgrader {args[0]} failed (exit {proc.returncode})")
    return proc.returncode, "".join(log)


def course_config(root: Path):
    """The course's nbgrader configuration (autograde/nbgrader_config.py), as nbgrader itself would load it."""
    from traitlets.config.loader import PyFileConfigLoader

    return PyFileConfigLoader("nbgrader_config.py", path=str(root / "autograde")).load_config()


@contextlib.contextmanager
def open_gradebook(root: Path) -> Iterator:
    """nbgrader's gradebook of the course at ``root``; exits if the course has none (opening would create one)."""
    if not (root / "autograde" / "gradebook.db").exists():
        raise SystemExit("autograde: no gradebook yet; run `python -m autograde release` first")
    from nbgrader.api import Gradebook

    config = course_config(root)
    with Gradebook(config.CourseDirectory.db_url, config.CourseDirectory.course_id) as gb:
        yield gb


def same_files(a: Path, b: Path) -> bool:
    """Whether folders ``a`` and ``b`` hold the same files with the same bytes."""

    def files(d: Path) -> dict[Path, bytes]:
        return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    return a.is_dir() and b.is_dir() and files(a) == files(b)


def graded_students(root: Path, lesson: str) -> list[str]:
    """Students with a submission of ``lesson`` in the gradebook (none if there is no gradebook)."""
    from nbgrader.api import MissingEntry

    if not (root / "autograde" / "gradebook.db").exists():
        return []
    with open_gradebook(root) as gb:
        try:
            return sorted(s.student.id for s in gb.find_assignment(lesson).submissions)
        except MissingEntry:
            return []


def cmd_release(root: Path, args: argparse.Namespace) -> None:
    """Generate the lessons into a staging folder, then swap each into lessons/; on any failure change nothing.

    nbgrader's own ``--force`` deletes lessons/NAME before it generates, and on failure leaves it deleted; and a
    failure while it creates the gradebook leaves a database without its schema version. So nbgrader writes to
    autograde/release/ (ignored by git), the gradebook is backed up first and put back if any lesson fails, and a
    lesson whose release is byte-identical to lessons/ is left untouched. nbgrader's output depends only on the
    solutions (checksums of cell sources, no timestamps), so releasing twice gives identical files.
    """
    names = checked_lessons(root, args.lessons) if args.lessons else lesson_names(root)
    gradebook = root / "autograde" / "gradebook.db"
    staging = root / "autograde" / "release"
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=staging) as tmp:
        source, out, backup = Path(tmp) / "solutions", Path(tmp) / "lessons", Path(tmp) / "gradebook.db"
        # One nbgrader run for every lesson (each run costs seconds of start-up): it takes a glob over its source
        # folder, so that folder holds copies of exactly the lessons asked for.
        for name in names:
            shutil.copytree(root / "solutions" / name, source / name)
        if gradebook.exists():
            shutil.copy2(gradebook, backup)
        dropped = {}
        try:
            if args.drop_grades:
                for name in names:
                    if students := graded_students(root, name):
                        with open_gradebook(root) as gb:
                            gb.remove_assignment(name)
                        dropped[name] = students
            code, log = nbgrader(
                root,
                "generate_assignment",
                "*",
                f"--CourseDirectory.source_directory={source}",
                f"--CourseDirectory.release_directory={out}",
                check=False,
            )
            if code or not all((out / name / f"{name}.ipynb").is_file() for name in names):
                raise SystemExit(release_failure(root, code, log))
        except BaseException:
            # Put back the gradebook exactly as it was (or remove the one this release created).
            if backup.exists():
                os.replace(backup, gradebook)
            else:
                gradebook.unlink(missing_ok=True)
            raise
        for name in names:
            dest = root / "lessons" / name
            if same_files(out / name, dest):
                print(f"lessons/{name}: unchanged")
                continue
            dest.parent.mkdir(exist_ok=True)
            if dest.exists():
                os.replace(dest, Path(tmp) / f"{name}.old")
            os.replace(out / name, dest)
            print(f"lessons/{name}: released")
    for name, students in dropped.items():
        for student in students:
            for step in ("autograded", "feedback"):
                shutil.rmtree(root / "autograde" / step / student / name, ignore_errors=True)
        print(
            f"dropped the grades of {len(students)} submission(s) of {name}; their notebooks stay in "
            f"autograde/submitted/. Grade them again: {command(root, 'autograde', name)}"
        )


def command(root: Path, *args: str) -> str:
    """The command line an instructor would type to run ``args`` on this course."""
    where = [] if root == COURSE_ROOT else ["--root", str(root)]
    return " ".join(["python -m autograde", *where, *args])


def release_failure(root: Path, code: int, log: str) -> str:
    """What went wrong, from nbgrader's log; for a refused re-release, what the instructor can do."""
    unchanged = "lessons/ and the gradebook are as they were."
    refused = sorted(set(REFUSED.findall(log)) | set(REFUSED_ASSIGNMENT.findall(log)))
    if not refused:
        failed = sorted(set(FAILED.findall(log)))
        return f"autograde release: nbgrader failed on {', '.join(failed) or 'the release'} (exit {code}). {unchanged}"
    lines = [
        f"autograde release: nbgrader refused to re-release {', '.join(refused)}: the release adds, removes or "
        f"renames graded, answer or locked cells, and the gradebook holds submissions graded against the old "
        f"ones. {unchanged}",
        "To release anyway and grade those lessons again (other lessons' grades stay, and the submitted notebooks "
        "stay in autograde/submitted/):",
        f"    {command(root, 'release', *refused, '--drop-grades')}",
        f"    {command(root, 'autograde', *refused)}",
    ]
    return "\n".join(lines)


def read_notebook(path: Path):
    """``path`` as a notebook, or a ValueError that says why it is not one."""
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except (OSError, ValueError, nbformat.ValidationError) as e:
        raise ValueError(f"{path}: not a readable notebook ({e.__class__.__name__}: {e})") from None


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def locked_cells(nb) -> dict[str, object]:
    """The cells of ``nb`` that grading overwrites with their released text (tests, setup), by grade_id."""
    from nbgrader.utils import is_locked

    return {grade_id(c): c for c in nb.cells if is_locked(c) and grade_id(c)}


def edited_locked_cells(nb, released) -> list[str]:
    """grade_ids of ``released``'s locked cells that ``nb`` changed or deleted.

    nbgrader's checksum covers a cell's source, type, points and grading flags. Comparing with the released lesson,
    not with the gradebook (which holds the hidden tests), leaves out the cells a student never touched.
    """
    from nbgrader.utils import compute_checksum

    mine = {grade_id(c): c for c in nb.cells}
    return [
        gid
        for gid, cell in locked_cells(released).items()
        if gid not in mine or compute_checksum(mine[gid]) != compute_checksum(cell)
    ]


def lesson_of_cells(root: Path, nb) -> str | None:
    """The released lesson a student's notebook came from: the one whose locked cells it carries most of.

    Only a notebook with nbgrader's release checksums is a student copy; a solution notebook has none.
    """
    ids = {gid for gid, c in locked_cells(nb).items() if "checksum" in c.metadata.nbgrader}
    if not ids:
        return None
    overlap = {n: len(ids & locked_cells(read_notebook(released_path(root, n))).keys()) for n in released(root)}
    best = max(overlap, key=overlap.get, default=None)
    return best if best and overlap[best] else None


def released_path(root: Path, lesson: str) -> Path:
    return root / "lessons" / lesson / f"{lesson}.ipynb"


def released(root: Path) -> list[str]:
    return [n for n in lesson_names(root) if released_path(root, n).is_file()]


def cmd_validate(root: Path, args: argparse.Namespace) -> int:
    """Run each notebook as the grader does and report its test cells; exit 1 if any notebook fails.

    In a student's copy, a locked cell the student edited is reported by grade_id and put back to its released
    text before the run, as grading does, so the report shows the checks as they will be graded.
    """
    import nbformat
    from nbconvert.filters import strip_ansi
    from nbgrader.validator import Validator

    config = course_config(root)
    config.Validator.update(invert=args.invert, validate_all=args.all_cells)
    os.environ.update(kernel_env(root))  # the kernel inherits this process's environment
    status = 0
    for notebook in map(Path, args.notebooks):
        try:
            nb = read_notebook(notebook)
        except ValueError as e:
            raise SystemExit(f"autograde validate: {e}") from None
        lesson = lesson_of_cells(root, nb)
        edited = []
        with tempfile.TemporaryDirectory() as tmp:
            path = notebook.resolve()
            if lesson:
                release = read_notebook(released_path(root, lesson))
                edited = edited_locked_cells(nb, release)
                if edited:
                    nb.cells = [restored(c, locked_cells(release)) for c in nb.cells]
                    path = Path(tmp) / notebook.name
                    nbformat.write(nb, path)
            # Edited cells are reported above and restored; nbgrader's own check would hide every failure.
            config.Validator.ignore_checksums = bool(lesson)
            results = Validator(config=config).validate(str(path))
        problems = [
            (kind, cell) for kind in ("type_changed", "changed", "passed", "failed") for cell in results.get(kind, [])
        ]
        print(f"{notebook}: {'FAILED' if problems or edited else 'ok'}")
        if edited:
            print(f"  edited, restored to the released text as grading will: {', '.join(edited)}")
        for kind, cell in problems:
            print(f"  {kind}: {cell['source'].splitlines()[0] if cell['source'] else '(empty cell)'}")
            if "raw_error" in cell:
                print("    " + strip_ansi(cell["raw_error"]).strip().replace("\n", "\n    "))
        status |= bool(problems or edited)
    return status


def restored(cell, released_cells: dict[str, object]):
    return copy.deepcopy(released_cells[grade_id(cell)]) if grade_id(cell) in released_cells else cell


def lesson_of_name(path: Path, known: Sequence[str]) -> str | None:
    """The lesson a file is by its name: the one lesson name in it, whatever a browser or Jupyter added around it
    (``NN_name (1).ipynb``, ``NN_name-Copy1.ipynb``, ``alice_NN_name.ipynb``)."""
    found = [n for n in known if n.lower() in path.stem.lower()]
    return found[0] if len(found) == 1 else None


def parse_time(text: str) -> datetime.datetime:
    """``text`` as a UTC time, by nbgrader's own parser (ISO 8601; a zone name or offset, else UTC)."""
    from nbgrader.utils import parse_utc

    try:
        return parse_utc(text).replace(tzinfo=datetime.timezone.utc)
    except (ValueError, OverflowError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time like 2025-03-01T17:00+01:00 ({e})") from None


def submission_time(folder: Path) -> str | None:
    stamp = folder / "timestamp.txt"
    return stamp.read_text().strip() if stamp.is_file() else None


def grade_ids(nb) -> set[str]:
    """The ids of ``nb``'s nbgrader cells (answers, tests, setup)."""
    return {grade_id(c) for c in nb.cells} - {None}


def collect_one(root: Path, student: str, file: Path, lesson: str, when: datetime.datetime | None) -> str:
    """Copy one notebook into autograde/submitted/STUDENT/LESSON/ with nbgrader's timestamp.txt; say what it did."""
    nb = read_notebook(file)
    note = ""
    if released_path(root, lesson).is_file() and not grade_ids(nb) & grade_ids(
        read_notebook(released_path(root, lesson))
    ):
        note = f" (warning: it holds none of {lesson}'s cells; check that it is the right notebook)"
    when = when or datetime.datetime.fromtimestamp(file.stat().st_mtime, datetime.timezone.utc)
    folder = root / "autograde" / "submitted" / student / lesson
    replaces = (folder / f"{lesson}.ipynb").is_file()
    earlier = submission_time(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Write beside the destination and rename, so an interrupted copy never leaves half a notebook to grade.
    staged = folder / f".{lesson}.ipynb.part"
    shutil.copyfile(file, staged)
    os.replace(staged, folder / f"{lesson}.ipynb")
    stamp = when.astimezone(datetime.timezone.utc).strftime(TIMESTAMP_FORMAT)
    (folder / "timestamp.txt").write_text(stamp + "\n")
    replaced = f"; replaces the earlier submission (timestamp {earlier or 'unknown'})" if replaces else ""
    return f"collected {file} as {folder.relative_to(root)}/{lesson}.ipynb, timestamp {stamp}{replaced}{note}"


def cmd_collect(root: Path, args: argparse.Namespace) -> int:
    """Each file on its own: one that cannot be collected gets a message, and the others are still collected."""
    if not STUDENT_ID.fullmatch(args.student):
        raise SystemExit(
            f"autograde collect: student {args.student!r}: use letters, digits and _ . @ - (not first), "
            "as it names a folder"
        )
    known = lesson_names(root)
    if args.lesson:
        checked_lessons(root, [args.lesson], known)
    status, seen = 0, {}
    for file in map(Path, args.files):
        lesson = args.lesson or lesson_of_name(file, known)
        try:
            if not file.is_file():
                raise ValueError(f"{file}: no such file")
            if lesson is None:
                raise ValueError(
                    f"{file}: its name holds no single lesson name; name the lesson with --lesson ({', '.join(known)})"
                )
            if lesson in seen:
                raise ValueError(f"{file}: {seen[lesson]} is already {args.student}'s {lesson} in this command")
            print(collect_one(root, args.student, file, lesson, args.time))
            seen[lesson] = file
        except ValueError as e:
            print(f"autograde collect: not collected: {e}", file=sys.stderr)
            status = 1
    return status


def submitted(root: Path) -> list[tuple[str, str]]:
    """(lesson, student) of every collected notebook."""
    return sorted((p.parent.name, p.parent.parent.name) for p in (root / "autograde" / "submitted").glob("*/*/*.ipynb"))


def submitted_lessons(root: Path) -> list[str]:
    return sorted({lesson for lesson, _ in submitted(root)})


def cmd_autograde(root: Path, args: argparse.Namespace) -> None:
    if not (root / "autograde" / "gradebook.db").exists():
        raise SystemExit("autograde: no gradebook yet; run `python -m autograde release` first")
    pairs = [(lesson, s) for lesson, s in submitted(root) if args.student in (None, s)]
    collected = sorted({lesson for lesson, _ in pairs})
    names = checked_lessons(root, args.lessons) if args.lessons else collected
    if missing := [n for n in names if n not in collected]:
        who = f" from {args.student}" if args.student else ""
        raise SystemExit(f"autograde: nothing collected{who} for {', '.join(missing)}; collected: {collected}")
    for name in names:
        nbgrader(root, "autograde", name, "--force", *([f"--student={args.student}"] if args.student else []))
    edits = []
    for name in names:
        lesson = read_notebook(released_path(root, name))
        for student in (s for lesson_, s in pairs if lesson_ == name):
            path = root / "autograde" / "submitted" / student / name / f"{name}.ipynb"
            if cells := edited_locked_cells(read_notebook(path), lesson):
                edits.append(f"{student} {name} ({', '.join(cells)})")
    if edits:
        print("autograde: locked cells students edited, graded with their released text: " + "; ".join(edits))


def cmd_feedback(root: Path, args: argparse.Namespace) -> None:
    for name in checked_lessons(root, args.lessons) if args.lessons else submitted_lessons(root):
        nbgrader(root, "generate_feedback", name, "--force")


def utc_text(when: datetime.datetime | None) -> str:
    """A gradebook time (naive, UTC) as ISO 8601 with its offset; empty if there is none."""
    return when.replace(tzinfo=datetime.timezone.utc).isoformat(sep=" ", timespec="seconds") if when else ""


EXPORT_COLUMNS = (
    "assignment",
    "duedate",
    "timestamp",
    "student_id",
    "last_name",
    "first_name",
    "email",
    "raw_score",
    "late_submission_penalty",
    "score",
    "max_score",
)


def cmd_export(root: Path, args: argparse.Namespace) -> None:
    """nbgrader's CSV columns, one row per lesson and graded student; a lesson never submitted has empty scores.

    nbgrader's own exporter writes 0.0 for a missing submission and an empty timestamp column unless a timestamp
    was collected; here a missing submission stays empty, so it cannot be mistaken for a zero.
    """
    from nbgrader.api import MissingEntry

    rows = []
    with open_gradebook(root) as gb:
        for assignment in gb.assignments:
            for student in gb.students:
                row = {
                    "assignment": assignment.name,
                    "duedate": utc_text(assignment.duedate),
                    "student_id": student.id,
                    "last_name": student.last_name or "",
                    "first_name": student.first_name or "",
                    "email": student.email or "",
                    "max_score": assignment.max_score,
                }
                try:
                    sub = gb.find_submission(assignment.name, student.id)
                except MissingEntry:
                    row.update(timestamp="", raw_score="", late_submission_penalty="", score="")
                else:
                    penalty = sub.late_submission_penalty or 0.0
                    row.update(
                        timestamp=utc_text(sub.timestamp),
                        raw_score=sub.score,
                        late_submission_penalty=penalty,
                        score=max(0.0, sub.score - penalty),
                    )
                rows.append(row)
    graded = {(r["assignment"], r["student_id"]) for r in rows if r["score"] != ""}
    if not graded:
        raise SystemExit(
            "autograde export: nothing graded yet, so no file written; run `collect` and `autograde` first"
        )
    if waiting := [f"{s} {lesson}" for lesson, s in submitted(root) if (lesson, s) not in graded]:
        print(f"autograde export: collected but not graded yet (run autograde): {'; '.join(waiting)}", file=sys.stderr)
    to = Path(args.to) if args.to else root / "autograde" / "exports" / "grades.csv"
    to.parent.mkdir(parents=True, exist_ok=True)
    with open(to, "w", newline="") as f:
        writer = csv.DictWriter(f, EXPORT_COLUMNS)
        writer.writeheader()
        writer.writerows(sorted(rows, key=lambda r: (r["assignment"], r["student_id"])))
    print(f"exported {to}: {len(graded)} graded, {len(rows) - len(graded)} not submitted (empty scores)")


def cmd_clean(root: Path, args: argparse.Namespace) -> None:
    for name in GRADING_DIRS:
        shutil.rmtree(root / "autograde" / name, ignore_errors=True)
    (root / "autograde" / "gradebook.db").unlink(missing_ok=True)
    print("removed the gradebook and autograde/{" + ",".join(GRADING_DIRS) + "}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograde", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=COURSE_ROOT, help="course root (default: this repository)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("release", help="lessons/ from solutions/; a failed release changes nothing")
    p.add_argument("lessons", nargs="*", help="lesson names (default: all)")
    p.add_argument(
        "--drop-grades",
        action="store_true",
        help="delete these lessons' grades first (their submitted notebooks stay), when nbgrader refuses otherwise",
    )
    p.set_defaults(func=cmd_release)
    p = sub.add_parser("validate", help="run a notebook in quick mode and report failing tests")
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--invert", action="store_true", help="fail if any test passes (for unanswered stubs)")
    p.add_argument("--all-cells", action="store_true", help="fail on an error in any cell, not only tests")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("collect", help="copy a student's notebooks into autograde/submitted/")
    p.add_argument("student")
    p.add_argument("files", nargs="+", help="notebooks; each file name must hold its lesson's name")
    p.add_argument("--lesson", help="the lesson every file is (for names like Untitled.ipynb)")
    p.add_argument("--time", type=parse_time, help="submission time (default: each file's modification time)")
    p.set_defaults(func=cmd_collect)
    p = sub.add_parser("autograde", help="grade submitted notebooks")
    p.add_argument("lessons", nargs="*", help="lesson names (default: all submitted)")
    p.add_argument("--student", help="only this student")
    p.set_defaults(func=cmd_autograde)
    p = sub.add_parser("feedback", help="HTML feedback for autograded notebooks")
    p.add_argument("lessons", nargs="*", help="lesson names (default: all submitted)")
    p.set_defaults(func=cmd_feedback)
    p = sub.add_parser("export", help="scores as CSV")
    p.add_argument("--to", help="CSV path (default: autograde/exports/grades.csv)")
    p.set_defaults(func=cmd_export)
    sub.add_parser("clean", help="delete the gradebook and all grading files").set_defaults(func=cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args.root.resolve(), args) or 0
