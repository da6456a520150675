"""Shared fixtures: a temporary copy of the course, released by nbgrader, for tests that write grading files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from autograde.cli import lesson_names

REPO = Path(__file__).resolve().parent.parent
LESSONS = lesson_names(REPO)
GRADING_FILES = ("gradebook.db", "submitted", "autograded", "feedback", "exports", "release", "__pycache__")
# What an instructor who never activated the environment has on PATH: the system's directories only.
BARE_ENV = {**os.environ, "PATH": os.defpath}


def run_autograde(
    root: Path, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m autograde`` on the course at ``root``, as an instructor would run it there (cwd=root, so the
    copy's own ``autograde`` package runs); ``env`` replaces the environment, ``BARE_ENV`` for instance."""
    result = subprocess.run(
        [sys.executable, "-m", "autograde", "--root", str(root), *args],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
    )
    if check and result.returncode:
        pytest.fail(f"autograde {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tests' tensors are tiny: a second OpenMP thread only adds spin-waiting, 10-60x slower on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def released_course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The course's solutions copied to a temporary root, with lessons/ generated there afresh."""
    root = course_copy(tmp_path_factory.mktemp("course"))
    run_autograde(root, "release")
    return root


def course_copy(root: Path, lessons: Sequence[str] = LESSONS, released: bool = False) -> Path:
    """The course's ``autograde/`` (no grading files) and the solutions of ``lessons`` in ``root``; with
    ``released``, the committed lessons/ too (for tests that need no release of their own)."""
    shutil.copytree(REPO / "autograde", root / "autograde", ignore=shutil.ignore_patterns(*GRADING_FILES))
    for name in lessons:
        shutil.copytree(REPO / "solutions" / name, root / "solutions" / name)
        if released:
            shutil.copytree(REPO / "lessons" / name, root / "lessons" / name)
    return root
