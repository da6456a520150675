"""Shared fixtures: a temporary copy of the course, released by nbgrader, for tests that write grading files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autograde.cli import lesson_names

REPO = Path(__file__).resolve().parent.parent
LESSONS = lesson_names(REPO)
GRADING_FILES = ("gradebook.db", "submitted", "autograded", "feedback", "exports", "__pycache__")


def run_autograde(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m autograde`` on the course at ``root``, as an instructor would run it there."""
    result = subprocess.run(
        [sys.executable, "-m", "autograde", "--root", str(root), *args], cwd=root, capture_output=True, text=True
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
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(REPO / "autograde", root / "autograde", ignore=shutil.ignore_patterns(*GRADING_FILES))
    shutil.copytree(REPO / "solutions", root / "solutions")
    run_autograde(root, "release")
    return root
