"""``python -m autograde <command>``: the course's instructor commands, all headless (see README.md).

    release [LESSON ...] [--drop-grades] [--exchange DIR] [--course ID]
                                           lessons/ from solutions/ (nbgrader generate_assignment), all or nothing;
                                           with an exchange, also published there (nbgrader release_assignment)
    validate NOTEBOOK ... [--invert] [--all-cells]
    collect STUDENT FILE ... [--lesson NAME] [--time WHEN]
                                           copy a student's notebooks into autograde/submitted/
    collect --from-exchange [LESSON ...] [--exchange DIR] [--course ID]
                                           every latest submission in the exchange (nbgrader collect)
    roster FILE.csv                        students (id, optional first_name, last_name, email) into the gradebook
    autograde [LESSON ...] [--student ID] [--jobs N]
                                           run every submission in quick mode and record its scores
    feedback [LESSON ...] [--exchange DIR] [--course ID]
                                           HTML feedback per submission, hidden tests removed; returned through
                                           the exchange (nbgrader release_feedback) with one
    export [--to CSV]                      all scores as CSV (default autograde/exports/grades.csv)
    clean                                  delete the gradebook and every submitted, graded and exported file

Every command acts on the course that holds this package (``--root`` picks another copy), so a test can grade a
temporary copy without touching the repository's gradebook. The exchange folder is ``--exchange`` or, without it,
the environment variable ``KVLAB_EXCHANGE``.
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
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from autograde import COURSE_ROOT

GRADING_DIRS = ("submitted", "autograded", "feedback", "exports")
# nbgrader's own format for timestamp.txt (nbgrader.exchange.abc.Exchange.timestamp_format), always in UTC.
TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%S.%f %Z"
STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]*")

# nbgrader log lines that say nothing an instructor can act on:
# - "Attribute ... has changed!": nbgrader compares a submitted locked cell with its source *including* the hidden
#   tests a student never sees, so it fires for every untouched test cell with hidden tests. `autograde` reports
#   the cells students really edited, against the release they fetched, in one line instead (edited_locked_cells).
# - "Removing existing assignment": `autograde` and `feedback` regrade from scratch on purpose (--force).
# - nbconvert's "Alternative text is missing on N image(s)" in feedback: the images are the lessons' own plots.
# - "display_data_priority not recognized by ClearHiddenTests": nbconvert's HTML exporter configures that option for
#   every preprocessor, and nbgrader's base preprocessor declares it without making it configurable; ClearHiddenTests
#   only edits cell sources, so the option means nothing to it.
NOISE = re.compile(
    r"Attribute '\w+' for cell .* has changed!"
    r"|Removing existing (assignment|notebook): "
    r"|Alternative text is missing on \d+ image"
    r"|Config option `?display_data_priority`? not recognized by `?ClearHiddenTests"
)
# The submission an nbgrader log line is about, from the notebook paths it logs (.../submitted/STUDENT/LESSON/...).
SUBMISSION_PATH = re.compile(r"submitted[/\\]([^/\\]+)[/\\]([^/\\]+)[/\\]")
PROBLEM = re.compile(r"\| (ERROR|WARNING|CRITICAL)\]")
# How nbgrader says it refused a re-release (SaveCells, GenerateAssignment._clean_old_notebooks), and that a lesson
# failed; each captures the lesson's name (one notebook per lesson, named as the lesson).
REFUSED = re.compile(r"Cannot add or remove cells for notebook '([^']+)'")
REFUSED_ASSIGNMENT = re.compile(r"Cannot modify existing assignment 'Assignment<([^>]+)>'")
FAILED = re.compile(r"error processing assignment '([^']+)'")
# The last line of a Python traceback: the exception and its message.
EXCEPTION_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)$", re.M)
SEE_TRACEBACK = re.compile(r"see the (the )?above traceback")
STDERR_LOCK = threading.Lock()
EXCHANGE_ENV = "KVLAB_EXCHANGE"


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
    - KVLAB_REPLAY_CACHE (unless set already): ``autograde/replays/``, where the kernels keep the capstone's
      replays that every submission runs alike, so only the first submission pays for them (``kvlab.course.disk_memo``).
    """
    env = dict(os.environ)
    env.setdefault("KVLAB_REPLAY_CACHE", str(root / "autograde" / "replays"))
    env["PATH"] = os.pathsep.join([*tool_dirs(), *(p for p in env.get("PATH", "").split(os.pathsep) if p)])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONWARNINGS="ignore", TQDM_DISABLE="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
    return env


def nbgrader(root: Path, *args: str, check: bool = True, tracebacks: bool = True) -> tuple[int, str]:
    """Run one nbgrader command on the course at ``root`` with its config.

    nbgrader's log (stderr) is passed through as it comes, less the lines ``NOISE`` matches, and less Python
    tracebacks without ``tracebacks`` (for a failure the caller explains itself); an error or warning that does not
    name the submission it is about (a cell timeout, for one) gets the student and lesson appended. Returns the exit
    status and the whole log; with ``check``, exits with a message if nbgrader failed.
    """
    # JupyterApp appends ".py" to the config file's name itself.
    config = root / "autograde" / "nbgrader_config"
    cmd = [sys.executable, "-m", "autograde.nbgrader_run", *args, f"--JupyterApp.config_file={config}"]
    env = kernel_env(root)
    # autograde.nbgrader_run is imported from the course being graded, as the hidden tests are.
    log, about, in_traceback = [], None, False
    with subprocess.Popen(cmd, cwd=root, env=env, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stderr:
            log.append(line)
            if found := SUBMISSION_PATH.search(line):
                about = found.groups()
            # nbgrader logs a traceback as one log line followed by indented lines (and a blank one).
            in_traceback = "Traceback (most recent call last)" in line or (in_traceback and line[:1].isspace())
            if NOISE.search(line) or (not tracebacks and (in_traceback or SEE_TRACEBACK.search(line))):
                continue
            if about and PROBLEM.search(line) and about[0] not in line:
                line = f"{line.rstrip()} [{about[0]} {about[1]}]\n"
            with STDERR_LOCK:
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
                tracebacks=False,
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
        now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
        for name in names:
            dest = root / "lessons" / name
            if released_path(root, name).is_file() and not release_history(root, name):
                # Released before this course kept a history (a fresh clone's lessons/): fetchable since ever.
                record_release(root, name, datetime.datetime(1970, 1, 1))
            if same_files(out / name, dest):
                print(f"lessons/{name}: unchanged")
            else:
                dest.parent.mkdir(exist_ok=True)
                if dest.exists():
                    os.replace(dest, Path(tmp) / f"{name}.old")
                os.replace(out / name, dest)
                print(f"lessons/{name}: released")
            record_release(root, name, now)
    for name, students in dropped.items():
        for student in students:
            for step in ("autograded", "feedback"):
                shutil.rmtree(root / "autograde" / step / student / name, ignore_errors=True)
        print(
            f"dropped the grades of {len(students)} submission(s) of {name}; their notebooks stay in "
            f"autograde/submitted/. Grade them again: {command(root, 'autograde', name)}"
        )
    if exchange := exchange_dir(args):
        for name in names:
            # --force replaces the lesson's earlier release in the outbound folder; students who fetched it keep
            # their copy, and autograde compares each submission with the release its student fetched.
            nbgrader(root, "release_assignment", name, "--force", *exchange_args(root, exchange, args.course))
        print(f"published {', '.join(names)} to {exchange} for course {course_id(root, args.course)}")


# Every released version of a lesson's notebook, named by the UTC time it was released (ignored by git: the times
# are this course's, not the repository's).
RELEASES = "releases"
RELEASE_TIME = "%Y%m%dT%H%M%S.%fZ"


def release_history(root: Path, lesson: str) -> list[tuple[datetime.datetime, Path]]:
    """(release time in UTC, naive; the notebook then released) of ``lesson``, oldest first."""
    folder = root / "autograde" / RELEASES / lesson
    found = [(datetime.datetime.strptime(p.stem, RELEASE_TIME), p) for p in folder.glob("*.ipynb")]
    return sorted(found)


def record_release(root: Path, lesson: str, when: datetime.datetime) -> None:
    """Keep lessons/LESSON's notebook as released at ``when``, unless it is the release kept last."""
    history = release_history(root, lesson)
    current = released_path(root, lesson)
    if history and history[-1][1].read_bytes() == current.read_bytes():
        return
    folder = root / "autograde" / RELEASES / lesson
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(current, folder / f"{when.strftime(RELEASE_TIME)}.ipynb")


def fetchable_releases(root: Path, lesson: str, submitted_at: datetime.datetime | None) -> list[Path]:
    """The releases of ``lesson`` a submission made at ``submitted_at`` (naive UTC) can have come from: every one
    released by then (a student may keep working on an older copy), or the first if it predates them all."""
    history = release_history(root, lesson)
    if not history:
        return [released_path(root, lesson)]
    fetched = [path for when, path in history if submitted_at is None or when <= submitted_at]
    return fetched or [history[0][1]]


def exchange_dir(args: argparse.Namespace) -> Path | None:
    """The nbgrader exchange folder: --exchange, else $KVLAB_EXCHANGE, else none."""
    where = getattr(args, "exchange", None) or os.environ.get(EXCHANGE_ENV)
    return Path(where).resolve() if where else None


def course_id(root: Path, given: str | None) -> str:
    """--course, else the course id in autograde/nbgrader_config.py, else "kvlab"."""
    return given or course_config(root).CourseDirectory.get("course_id") or "kvlab"


def exchange_args(root: Path, exchange: Path, course: str | None) -> list[str]:
    return [f"--Exchange.root={exchange}", f"--CourseDirectory.course_id={course_id(root, course)}"]


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
        causes = [": ".join(m) for m in EXCEPTION_LINE.findall(log)]
        cause = f" The error: {causes[-1]}." if causes else ""
        return (
            f"autograde release: nbgrader failed on {', '.join(failed) or 'the release'} (exit {code}).{cause} "
            f"{unchanged}"
        )
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


def own_cells(root: Path) -> dict[str, set[str]]:
    """Each released lesson's grade_ids that no other lesson has (every lesson shares ``setup-001``, for one), so
    that a notebook can be told apart by them."""
    ids = {n: grade_ids(read_notebook(released_path(root, n))) for n in released(root)}
    return {n: mine - set().union(*(v for m, v in ids.items() if m != n)) for n, mine in ids.items()}


def check_lesson(root: Path, nb, file: Path, lesson: str) -> str:
    """Nothing ("") if notebook ``nb`` holds cells only ``lesson`` has; a warning if it holds no lesson's own
    cells; a ValueError naming both lessons if it holds another lesson's."""
    own = own_cells(root)
    found = grade_ids(nb)
    if not own.get(lesson) or own[lesson] & found:
        return ""
    if others := [n for n, cells in own.items() if cells & found]:
        raise ValueError(
            f"{file} holds {' and '.join(others)}'s cells, none of {lesson}'s: it is not {lesson}. Check the file, or "
            f"collect it as {others[0]} (--lesson {others[0]})"
        )
    return f" (warning: it holds none of {lesson}'s cells; check that it is the right notebook)"


def collect_one(root: Path, student: str, file: Path, lesson: str, when: datetime.datetime | None) -> str:
    """Copy one notebook into autograde/submitted/STUDENT/LESSON/ with nbgrader's timestamp.txt; say what it did."""
    nb = read_notebook(file)
    note = check_lesson(root, nb, file, lesson)
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
    if args.from_exchange:
        return collect_from_exchange(root, args)
    if len(args.items) < 2:
        raise SystemExit("autograde collect: name a student and their notebooks (STUDENT FILE ...), or --from-exchange")
    student, files = args.items[0], args.items[1:]
    if not STUDENT_ID.fullmatch(student):
        raise SystemExit(
            f"autograde collect: student {student!r}: use letters, digits and _ . @ - (not first), as it names a folder"
        )
    known = lesson_names(root)
    if args.lesson:
        checked_lessons(root, [args.lesson], known)
    status, seen = 0, {}
    for file in map(Path, files):
        lesson = args.lesson or lesson_of_name(file, known)
        try:
            if not file.is_file():
                raise ValueError(f"{file}: no such file")
            if lesson is None:
                raise ValueError(
                    f"{file}: its name holds no single lesson name; name the lesson with --lesson ({', '.join(known)})"
                )
            if lesson in seen:
                raise ValueError(f"{file}: {seen[lesson]} is already {student}'s {lesson} in this command")
            print(collect_one(root, student, file, lesson, args.time))
            seen[lesson] = file
        except ValueError as e:
            print(f"autograde collect: not collected: {e}", file=sys.stderr)
            status = 1
    return status


def collect_from_exchange(root: Path, args: argparse.Namespace) -> int:
    """nbgrader collect for each lesson: every student's latest submission, with the timestamp nbgrader's submit
    wrote, replacing an older one already collected (--update)."""
    if args.lesson or args.time:
        raise SystemExit(
            "autograde collect --from-exchange: --lesson and --time are for files; submissions keep theirs"
        )
    exchange = exchange_dir(args)
    if exchange is None:
        raise SystemExit(f"autograde collect --from-exchange: name the exchange with --exchange DIR or ${EXCHANGE_ENV}")
    inbound = exchange / course_id(root, args.course) / "inbound"
    names = checked_lessons(root, args.items) if args.items else released(root)
    before = set(submitted(root))
    for name in names:
        # Where every student's server runs as one Unix user (a hub's SimpleLocalProcessSpawner, or servers that
        # all run as the same container user), every submission belongs to that user, so nbgrader's check that a
        # submission's owner is the student it names would warn "cheating attempt?" for each of them. The student
        # id comes from the submission's name, which the hub sets; the README says when to turn the check back on.
        if any(inbound.glob(f"*+{name}+*")):
            nbgrader(
                root,
                "collect",
                name,
                "--update",
                "--ExchangeCollect.check_owner=False",
                *exchange_args(root, exchange, args.course),
            )
    got = [f"{s} {lesson}" for lesson, s in submitted(root) if lesson in names]
    new = len(set(submitted(root)) - before)
    print(f"collected from {inbound}: {len(got)} submission(s) of {', '.join(names)} ({new} new)")
    return 0


def submitted(root: Path) -> list[tuple[str, str]]:
    """(lesson, student) of every collected notebook."""
    return sorted((p.parent.name, p.parent.parent.name) for p in (root / "autograde" / "submitted").glob("*/*/*.ipynb"))


def submitted_lessons(root: Path) -> list[str]:
    return sorted({lesson for lesson, _ in submitted(root)})


def submitted_at(root: Path, student: str, lesson: str) -> datetime.datetime | None:
    """The submission's time from its timestamp.txt (naive UTC, as the gradebook keeps it), if it has one."""
    from nbgrader.utils import parse_utc

    text = submission_time(root / "autograde" / "submitted" / student / lesson)
    return parse_utc(text).replace(tzinfo=None) if text else None


def cmd_autograde(root: Path, args: argparse.Namespace) -> None:
    if not (root / "autograde" / "gradebook.db").exists():
        raise SystemExit("autograde: no gradebook yet; run `python -m autograde release` first")
    if args.jobs < 1:
        raise SystemExit("autograde: --jobs must be at least 1")
    pairs = [(lesson, s) for lesson, s in submitted(root) if args.student in (None, s)]
    collected = sorted({lesson for lesson, _ in pairs})
    names = checked_lessons(root, args.lessons) if args.lessons else collected
    if missing := [n for n in names if n not in collected]:
        who = f" from {args.student}" if args.student else ""
        raise SystemExit(f"autograde: nothing collected{who} for {', '.join(missing)}; collected: {collected}")
    pairs = [(lesson, s) for lesson, s in pairs if lesson in names]
    if args.jobs == 1:
        for name in names:
            nbgrader(root, "autograde", name, "--force", *([f"--student={args.student}"] if args.student else []))
    else:
        grade_in_parallel(root, pairs, args.jobs)
    edits = []
    for name, student in pairs:
        nb = read_notebook(root / "autograde" / "submitted" / student / name / f"{name}.ipynb")
        # Against the release the student fetched: a test edited and released since is no edit of theirs.
        fetched = fetchable_releases(root, name, submitted_at(root, student, name))
        if cells := min((edited_locked_cells(nb, read_notebook(r)) for r in fetched), key=len):
            edits.append(f"{student} {name} ({', '.join(cells)})")
    if edits:
        print("autograde: locked cells students edited, graded with their released text: " + "; ".join(edits))


def grade_in_parallel(root: Path, pairs: Sequence[tuple[str, str]], jobs: int) -> None:
    """Grade the (lesson, student) ``pairs`` in ``jobs`` nbgrader processes at once, then record every score in the
    course's gradebook.

    nbgrader's gradebook is one sqlite file, and nbgrader opens it, writes and commits at several points while it
    grades a notebook, without retrying when another process holds the write lock: processes sharing it fail at
    random with "database is locked". So each process grades its share of the submissions into its own copy of the
    gradebook, reading them from a folder that holds only its share; its notebooks go to the course's
    autograde/autograded/ as usual (each process writes other students' folders). Only this process writes the
    course's gradebook, one process's results after another (merge_grades).
    """
    shares = [list(pairs[i::jobs]) for i in range(jobs) if pairs[i::jobs]]
    for _, student in pairs:  # made here, so that no two processes race to create the same folder
        (root / "autograde" / "autograded" / student).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root / "autograde") as tmp:

        def grade(k: int) -> Path:
            scratch = Path(tmp) / str(k)
            for lesson, student in shares[k]:
                src = root / "autograde" / "submitted" / student / lesson
                shutil.copytree(src, scratch / "submitted" / student / lesson)
            shutil.copy2(root / "autograde" / "gradebook.db", scratch / "gradebook.db")
            for lesson in sorted({lesson for lesson, _ in shares[k]}):
                nbgrader(
                    root,
                    "autograde",
                    lesson,
                    "--force",
                    f"--CourseDirectory.submitted_directory={scratch / 'submitted'}",
                    f"--CourseDirectory.db_url=sqlite:///{scratch / 'gradebook.db'}",
                )
            return scratch / "gradebook.db"

        with ThreadPoolExecutor(len(shares)) as pool:
            gradebooks = list(pool.map(grade, range(len(shares))))
        for gradebook, share in zip(gradebooks, shares, strict=True):
            merge_grades(root, gradebook, share)


def merge_grades(root: Path, scratch: Path, pairs: Sequence[tuple[str, str]]) -> None:
    """Copy the submissions ``pairs`` (lesson, student), with every score and comment, from gradebook ``scratch``
    into the course's, replacing what it held for them (as nbgrader's autograde --force does)."""
    from nbgrader.api import Gradebook, MissingEntry
    from sqlalchemy.exc import SAWarning

    config = course_config(root)
    course = config.CourseDirectory.course_id
    # nbgrader's add_submission trips an SQLAlchemy 2 autoflush warning while it builds the submission's rows, as
    # it does inside nbgrader's own autograde; the rows are recorded.
    with warnings.catch_warnings(), Gradebook(f"sqlite:///{scratch}", course) as src, open_gradebook(root) as dst:
        warnings.simplefilter("ignore", SAWarning)
        for lesson, student in pairs:
            sub = src.find_submission(lesson, student)
            person = sub.student
            dst.update_or_create_student(
                student, **{k: getattr(person, k) for k in ("first_name", "last_name", "email") if getattr(person, k)}
            )
            with contextlib.suppress(MissingEntry):
                dst.remove_submission(lesson, student)
            dst.add_submission(lesson, student, timestamp=sub.timestamp, extension=sub.extension)
            for nb in sub.notebooks:
                mine = dst.find_submission_notebook(nb.name, lesson, student)
                mine.flagged, mine.late_submission_penalty = nb.flagged, nb.late_submission_penalty
                for g in nb.grades:
                    to = dst.find_grade(g.name, nb.name, lesson, student)
                    for field in ("auto_score", "manual_score", "extra_credit", "needs_manual_grade"):
                        setattr(to, field, getattr(g, field))
                for c in nb.comments:
                    to = dst.find_comment(c.name, nb.name, lesson, student)
                    to.auto_comment, to.manual_comment = c.auto_comment, c.manual_comment
            dst.db.commit()


def cmd_feedback(root: Path, args: argparse.Namespace) -> None:
    names = checked_lessons(root, args.lessons) if args.lessons else submitted_lessons(root)
    for name in names:
        nbgrader(root, "generate_feedback", name, "--force")
    if exchange := exchange_dir(args):
        for name in names:
            # nbgrader matches each feedback file to the submission it is about by the notebook's and timestamp's
            # hash, so only submissions collected from the exchange get theirs (fetch_feedback on the student's side).
            nbgrader(root, "release_feedback", name, *exchange_args(root, exchange, args.course))
        print(f"returned the feedback of {', '.join(names)} to {exchange}")


ROSTER_COLUMNS = ("id", "first_name", "last_name", "email")


def cmd_roster(root: Path, args: argparse.Namespace) -> None:
    """Add (or update) every student of a CSV roster in the gradebook, so that one who submits nothing still has a
    row per lesson in the export."""
    try:
        with open(args.file, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            columns = [c.strip() for c in reader.fieldnames or []]
            people = [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise SystemExit(f"autograde roster: cannot read {args.file}: {e}") from None
    if "id" not in columns or set(columns) - set(ROSTER_COLUMNS):
        allowed = ", ".join(ROSTER_COLUMNS[1:])
        raise SystemExit(f"autograde roster: {args.file}: columns {columns}; it needs `id`, and may have {allowed}")
    bad = [f"line {i + 2}: {p['id']!r}" for i, p in enumerate(people) if not STUDENT_ID.fullmatch(p["id"])]
    if bad:
        raise SystemExit(
            f"autograde roster: {args.file}: student ids use letters, digits and _ . @ - (not first): {'; '.join(bad)}"
        )
    with open_gradebook(root) as gb:
        known = {s.id for s in gb.students}
        for person in people:
            gb.update_or_create_student(person["id"], **{k: v for k, v in person.items() if k != "id" and v})
    new = len({p["id"] for p in people} - known)
    print(f"roster: {len(people)} student(s) in the gradebook, {new} new")


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
    was collected; here a missing submission stays empty, so it cannot be mistaken for a zero. A submission
    collected again after it was graded (its timestamp.txt no longer the gradebook's) refuses the export until it
    is graded again, as the gradebook's score and time are the old submission's.
    """
    from nbgrader.api import MissingEntry

    collected = {(s, lesson) for lesson, s in submitted(root)}
    rows, stale = [], []
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
                    if (student.id, assignment.name) in collected and (
                        submitted_at(root, student.id, assignment.name) != sub.timestamp
                    ):
                        stale.append(f"{student.id} {assignment.name}")
                    row.update(
                        timestamp=utc_text(sub.timestamp),
                        raw_score=sub.score,
                        late_submission_penalty=penalty,
                        score=max(0.0, sub.score - penalty),
                    )
                rows.append(row)
    if stale:
        raise SystemExit(
            "autograde export: collected again since graded, so the gradebook holds the grade of an older "
            f"submission: {'; '.join(stale)}. Nothing written; grade them again first: "
            f"{command(root, 'autograde', *sorted({s.split()[1] for s in stale}))}"
        )
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
    exchange_options(p, "also publish the lessons to this exchange")
    p.set_defaults(func=cmd_release)
    p = sub.add_parser("validate", help="run a notebook in quick mode and report failing tests")
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--invert", action="store_true", help="fail if any test passes (for unanswered stubs)")
    p.add_argument("--all-cells", action="store_true", help="fail on an error in any cell, not only tests")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser(
        "collect",
        help="copy a student's notebooks into autograde/submitted/, or every submission in the exchange",
        usage="%(prog)s STUDENT FILE ... [--lesson NAME] [--time WHEN]\n"
        "       %(prog)s --from-exchange [LESSON ...] [--exchange DIR] [--course ID]",
    )
    p.add_argument("items", nargs="*", metavar="STUDENT FILE ... | LESSON ...")
    p.add_argument("--lesson", help="the lesson every file is (for names like Untitled.ipynb)")
    p.add_argument("--time", type=parse_time, help="submission time (default: each file's modification time)")
    p.add_argument(
        "--from-exchange", action="store_true", help="collect the latest submission of every student from the exchange"
    )
    exchange_options(p)
    p.set_defaults(func=cmd_collect)
    p = sub.add_parser("roster", help="load the students of a CSV (id[,first_name,last_name,email]) into the gradebook")
    p.add_argument("file", help="CSV file with a header line")
    p.set_defaults(func=cmd_roster)
    p = sub.add_parser("autograde", help="grade submitted notebooks")
    p.add_argument("lessons", nargs="*", help="lesson names (default: all submitted)")
    p.add_argument("--student", help="only this student")
    p.add_argument("--jobs", type=int, default=1, help="nbgrader processes grading at once (default 1)")
    p.set_defaults(func=cmd_autograde)
    p = sub.add_parser("feedback", help="HTML feedback for autograded notebooks")
    p.add_argument("lessons", nargs="*", help="lesson names (default: all submitted)")
    exchange_options(p, "also return the feedback through this exchange")
    p.set_defaults(func=cmd_feedback)
    p = sub.add_parser("export", help="scores as CSV")
    p.add_argument("--to", help="CSV path (default: autograde/exports/grades.csv)")
    p.set_defaults(func=cmd_export)
    sub.add_parser("clean", help="delete the gradebook and all grading files").set_defaults(func=cmd_clean)
    return parser


def exchange_options(p: argparse.ArgumentParser, what: str = "the exchange") -> None:
    p.add_argument("--exchange", metavar="DIR", help=f"nbgrader exchange folder: {what} (default: ${EXCHANGE_ENV})")
    p.add_argument("--course", metavar="ID", help="course id in the exchange (default: nbgrader_config's, or kvlab)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args.root.resolve(), args) or 0
