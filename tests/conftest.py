"""Shared fixtures: where a test runs (``target``: CPU in fp32, CPU in bf16, CUDA in bf16), and a temporary copy of
the course, released by nbgrader, for tests that write grading files.

Tests marked ``gpu`` need CUDA and are skipped without it; ``pytest -m gpu`` runs only them (``benchmarks/gpu_check.py``
does, on a lent GPU).

How the suite is run (README, Contributing): ``pytest -m "not slow"`` is the inner loop; ``python3 bootstrap.py
test`` runs everything, the tests not marked ``serial`` spread over the CPUs by pytest-xdist one file to a worker
(``--dist loadfile``, so a module's fixture is built once), then the ``serial`` ones alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from autograde.cli import lesson_names
from autograde.lean import skip_unused_imports

# As every autograde command does: nbformat's jsonschema would compile a grammar no notebook schema uses, several
# seconds of every pytest process's start (and of each pytest-xdist worker's).
skip_unused_imports()

REPO = Path(__file__).resolve().parent.parent
LESSONS = lesson_names(REPO)
GRADING_FILES = ("gradebook.db", "submitted", "autograded", "feedback", "exports", "release", "releases", "__pycache__")
# What an instructor who never activated the environment has on PATH: the system's directories only.
BARE_ENV = {**os.environ, "PATH": os.defpath}


def run_autograde(
    root: Path, *args: str, check: bool = True, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``python -m autograde`` on the course at ``root``, as an instructor would run it there (cwd=root, so the
    copy's own ``autograde`` package runs); ``env`` replaces the environment, ``BARE_ENV`` for instance."""
    result = subprocess.run(
        [sys.executable, "-m", "autograde", "--root", str(root), *args],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if check and result.returncode:
        pytest.fail(f"autograde {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@dataclass(frozen=True)
class Target:
    """A device and the model dtype a test uses there: fp32 on CPU, as the course runs; bf16 on CUDA, as serving
    does. ``cpu-bf16`` runs the CUDA configuration on the CPU, so its tolerances are tested where no GPU is."""

    device: str
    dtype: str

    def tol(self, fp32: dict[str, float], bf16: dict[str, float]) -> dict[str, float]:
        """``assert_close`` tolerances for this dtype: a test states both, each with its reason."""
        return fp32 if self.dtype == "fp32" else bf16


TARGETS = [
    pytest.param(Target("cpu", "fp32"), id="cpu"),
    pytest.param(Target("cpu", "bf16"), id="cpu-bf16"),
    pytest.param(Target("cuda", "bf16"), id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> Target:
    """Run the test once per ``TARGETS`` entry; the CUDA one is marked ``gpu``."""
    return request.param


# The files whose tests take minutes, longest first (measured on a busy 2-core machine: grading about 6 min, the
# rest 1-3 min each): collected first, so that pytest-xdist, told to keep the collection's order
# (--no-loadscope-reorder), starts them first and its workers finish at about the same time.
STARTS_FIRST = (
    "test_grading.py",
    "test_instructor.py",
    "test_instructor_exchange.py",
    "test_classroom_hub.py",
    "test_classroom_browser.py",
    "test_incident.py",
    "test_notebooks.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(STARTS_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's tests stay together
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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
