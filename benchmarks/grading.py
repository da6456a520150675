"""CPU seconds to autograde one submission of each lesson, as the grader runs it (quick mode), and what a class costs.

    python benchmarks/grading.py                          # every lesson
    python benchmarks/grading.py 04_batching 11_capstone_incident --students 3 --class-size 200

Each lesson is released into a temporary copy of the course, and a submission answered with the solution's code
is graded twice over with ``python -m autograde autograde LESSON``:

- **first**: the first student's alone, on an empty replay cache (``kvlab.course.disk_memo``: the capstone keeps there
  the replays every submission runs alike);
- **each**: then ``--students`` submissions together (the first again, and others), once the cache holds what
  the first one stored: what each further submission of a class costs.

The CPU time is the command's and every process it waited for (nbgrader and each notebook's kernel, read with
``resource.getrusage(RUSAGE_CHILDREN)``), per submission; each command includes one nbgrader start-up (several
seconds), which the ``--students`` of the second share. A class of ``--class-size`` costs one first and the rest at
the second rate, so the 30 s target is judged on the second: what a class pays per submission once the replays
every student shares are stored. A submission whose answer no earlier one gave still replays its own (lesson
11's fix: its check's four replays at scale and two on the checkpoint); the first column bounds that cost.

CPU seconds depend far less on other load than wall seconds do, but a busy machine still inflates them a little
(cache misses, and timing loops in the lessons that run until they have enough samples); the load average is
printed beside the results.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autograde.cli import lesson_names  # noqa: E402 (the repository root is put on the path first)

TARGET_CPU_S = 30.0
SOLUTION_MARKER = re.compile(r"(?m)^\s*### (BEGIN|END) SOLUTION\n?")


def answered(root: Path, lesson: str, dest: Path) -> Path:
    """The released ``lesson`` with the solution's code in each answer cell: a student who got everything right."""
    solution = nbformat.read(root / "solutions" / lesson / f"{lesson}.ipynb", as_version=4)
    answers = {
        c.metadata.nbgrader["grade_id"]: SOLUTION_MARKER.sub("", c.source)
        for c in solution.cells
        if c.metadata.get("nbgrader", {}).get("solution")
    }
    nb = nbformat.read(root / "lessons" / lesson / f"{lesson}.ipynb", as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid in answers:
            cell.source = answers[gid]
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return dest


def autograde(root: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autograde", "--root", str(root), *args]
    env = {k: v for k, v in os.environ.items() if k != "KVLAB_REPLAY_CACHE"}  # the course's own, empty at first
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
    if result.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def graded(root: Path, lesson: str, n: int) -> tuple[float, float]:
    """CPU and wall seconds per submission of one ``autograde LESSON`` over its ``n`` collected submissions."""
    cpu, wall = children_cpu_s(), time.perf_counter()
    autograde(root, "autograde", lesson)
    return (children_cpu_s() - cpu) / n, (time.perf_counter() - wall) / n


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def scores(root: Path) -> dict[tuple[str, str], str]:
    """(lesson, student) -> "score/max" from the exported CSV."""
    import csv

    autograde(root, "export", "--to", str(root / "grades.csv"))
    with open(root / "grades.csv", newline="") as f:
        return {(r["assignment"], r["student_id"]): f"{r['score']}/{r['max_score']}" for r in csv.DictReader(f)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lessons", nargs="*", help="lesson names (default: every lesson)")
    parser.add_argument(
        "--students", type=int, default=3, help="submissions graded together after the first (default 3)"
    )
    parser.add_argument("--class-size", type=int, default=200, help="students in the class (default 200)")
    args = parser.parse_args()
    known = lesson_names(REPO)
    lessons = args.lessons or known
    if unknown := sorted(set(lessons) - set(known)):
        raise SystemExit(f"no lesson {', '.join(unknown)}; lessons: {', '.join(known)}")
    if args.students < 1:
        raise SystemExit("--students must be at least 1")
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "course"
        shutil.copytree(
            REPO / "autograde",
            root / "autograde",
            ignore=shutil.ignore_patterns(
                "gradebook.db", "submitted", "autograded", "feedback", "exports", "rel*", "replays"
            ),
        )
        for lesson in lessons:
            shutil.copytree(REPO / "solutions" / lesson, root / "solutions" / lesson)
        autograde(root, "release", *lessons)
        files = {lesson: answered(root, lesson, Path(tmp) / "submissions" / f"{lesson}.ipynb") for lesson in lessons}
        print(
            f"{'lesson':24s} {'CPU s first':>11} {'CPU s each':>10} {'wall s each':>11} "
            f"{'CPU h/' + str(args.class_size):>9}  score  target"
        )
        total = 0.0
        for lesson in lessons:
            autograde(root, "collect", "student0", str(files[lesson]))
            first, _ = graded(root, lesson, 1)
            for i in range(1, args.students):
                autograde(root, "collect", f"student{i}", str(files[lesson]))
            each, wall = graded(root, lesson, args.students)
            hours = (first + each * (args.class_size - 1)) / 3600
            total += hours
            verdict = "ok" if each <= TARGET_CPU_S else f"OVER {TARGET_CPU_S:.0f} s"
            score = scores(root)[(lesson, "student0")]
            print(f"{lesson:24s} {first:11.1f} {each:10.1f} {wall:11.1f} {hours:9.2f}  {score:>5}  {verdict}")
        print(f"{'all listed':24s} {'':11s} {'':10s} {'':11s} {total:9.2f}")
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
