"""``python -m autograde <command>``: the course's instructor commands, all headless (see README.md).

    release [LESSON ...]          lessons/ from solutions/ (nbgrader generate_assignment), deterministic
    validate NOTEBOOK ... [--invert]
    collect STUDENT NOTEBOOK ...  copy a student's notebooks into autograde/submitted/
    autograde [LESSON ...]        run every submission in quick mode and record its scores
    feedback [LESSON ...]         HTML feedback per submission, hidden tests removed
    export [--to CSV]             all scores as CSV (default autograde/exports/grades.csv)
    clean                         delete the gradebook and every submitted, graded and exported file

Every command acts on the course that holds this package (``--root`` picks another copy), so a test can grade a
temporary copy without touching the repository's gradebook.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from autograde import COURSE_ROOT

GRADING_DIRS = ("submitted", "autograded", "feedback", "exports")


def lesson_names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())


def kernel_env(root: Path) -> dict[str, str]:
    """The environment nbgrader and its kernels run in.

    - PYTHONPATH: hidden test cells ``import autograde.hidden`` from a notebook in a student's folder.
    - PYTHONWARNINGS, TQDM_DISABLE: nbgrader zeroes a test cell that writes to stderr; warnings raised while
      modules import (before a lesson's setup cell filters them) and progress bars would.
    - MPLBACKEND: plots go into the notebook, never to a window.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONWARNINGS="ignore", TQDM_DISABLE="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
    return env


def nbgrader(root: Path, *args: str) -> None:
    """Run one nbgrader command on the course at ``root`` with its config; raise if nbgrader fails."""
    # JupyterApp appends ".py" to the config file's name itself.
    config = root / "autograde" / "nbgrader_config"
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--JupyterApp.config_file={config}"]
    result = subprocess.run(cmd, cwd=root, env=kernel_env(root))
    if result.returncode:
        raise SystemExit(f"autograde: nbgrader {args[0]} failed (exit {result.returncode})")


def cmd_release(root: Path, args: argparse.Namespace) -> None:
    # nbgrader's output depends only on the solutions (checksums of cell sources, no timestamps), so releasing
    # twice gives identical files; the tests hold lessons/ to that.
    for name in args.lessons or lesson_names(root):
        nbgrader(root, "generate_assignment", name, "--force")


def cmd_validate(root: Path, args: argparse.Namespace) -> int:
    """Run each notebook as nbgrader does and report its test cells; exit 1 if any notebook fails."""
    from nbconvert.filters import strip_ansi
    from nbgrader.validator import Validator
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root / "autograde")).load_config()
    config.Validator.update(invert=args.invert, validate_all=args.all_cells)
    os.environ.update(kernel_env(root))  # the kernel inherits this process's environment
    status = 0
    for notebook in args.notebooks:
        if not Path(notebook).is_file():
            raise SystemExit(f"autograde validate: {notebook}: no such notebook")
        results = Validator(config=config).validate(str(Path(notebook).resolve()))
        problems = [
            (kind, cell) for kind in ("type_changed", "changed", "passed", "failed") for cell in results.get(kind, [])
        ]
        print(f"{notebook}: {'FAILED' if problems else 'ok'}")
        for kind, cell in problems:
            print(f"  {kind}: {cell['source'].splitlines()[0] if cell['source'] else '(empty cell)'}")
            if "raw_error" in cell:
                print("    " + strip_ansi(cell["raw_error"]).strip().replace("\n", "\n    "))
        status |= bool(problems)
    return status


def cmd_collect(root: Path, args: argparse.Namespace) -> None:
    known = lesson_names(root)
    for notebook in map(Path, args.notebooks):
        name = notebook.stem
        if name not in known:
            raise SystemExit(f"autograde collect: {notebook}: not a lesson notebook; allowed: {', '.join(known)}")
        dest = root / "autograde" / "submitted" / args.student / name / f"{name}.ipynb"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(notebook, dest)
        print(f"collected {dest.relative_to(root)}")


def submitted_lessons(root: Path) -> list[str]:
    return sorted({p.parent.name for p in (root / "autograde" / "submitted").glob("*/*/*.ipynb")})


def cmd_autograde(root: Path, args: argparse.Namespace) -> None:
    if not (root / "autograde" / "gradebook.db").exists():
        raise SystemExit("autograde: no gradebook; run `python -m autograde release` first")
    for name in args.lessons or submitted_lessons(root):
        nbgrader(root, "autograde", name, "--force", *([f"--student={args.student}"] if args.student else []))


def cmd_feedback(root: Path, args: argparse.Namespace) -> None:
    for name in args.lessons or submitted_lessons(root):
        nbgrader(root, "generate_feedback", name, "--force")


def cmd_export(root: Path, args: argparse.Namespace) -> None:
    to = Path(args.to) if args.to else root / "autograde" / "exports" / "grades.csv"
    to.parent.mkdir(parents=True, exist_ok=True)
    nbgrader(root, "export", f"--to={to.resolve()}")
    print(f"exported {to}")


def cmd_clean(root: Path, args: argparse.Namespace) -> None:
    for name in GRADING_DIRS:
        shutil.rmtree(root / "autograde" / name, ignore_errors=True)
    (root / "autograde" / "gradebook.db").unlink(missing_ok=True)
    print("removed the gradebook and autograde/{" + ",".join(GRADING_DIRS) + "}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograde", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=COURSE_ROOT, help="course root (default: this repository)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("release", help="lessons/ from solutions/")
    p.add_argument("lessons", nargs="*", help="lesson names (default: all)")
    p.set_defaults(func=cmd_release)
    p = sub.add_parser("validate", help="run a notebook in quick mode and report failing tests")
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--invert", action="store_true", help="fail if any test passes (for unanswered stubs)")
    p.add_argument("--all-cells", action="store_true", help="fail on an error in any cell, not only tests")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("collect", help="copy a student's notebooks into autograde/submitted/")
    p.add_argument("student")
    p.add_argument("notebooks", nargs="+")
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
