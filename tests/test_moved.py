"""The previous release's module paths (kvlab._moved) still import, silently, with every name their modules held."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from kvlab._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_serves_every_public_name_of_its_new_modules(old: str) -> None:
    module = importlib.import_module(old)
    for new in MOVED[old]:
        names = [n for n in vars(importlib.import_module(new)) if not n.startswith("_")]
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{old} lacks {missing} of {new}"


def test_an_old_notebook_import_cell_runs_and_prints_nothing() -> None:
    """What lesson 03 of the previous release imported, in a fresh interpreter: nbgrader zeroes a cell that writes
    to stderr, so the old paths must not warn."""
    cell = (
        "from kvlab import KVCache, get_model, roofline, timing\n"
        "from kvlab.bench import Sweep, fit_line, percentile, sweep_context\n"
        "from kvlab.cache.window import WindowKVCache\n"
        "bw = timing.bandwidth_buffer_mb(quick=True)\n"
    )
    done = subprocess.run([sys.executable, "-W", "default", "-c", cell], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr, done.stderr[-2000:]


def test_a_renamed_name_is_served_under_its_old_name() -> None:
    from kvlab.breakdown import breakdown, report  # lesson 02 of the previous release

    from kvlab.measure import breakdown_table

    assert report is breakdown_table and callable(breakdown)


def test_a_path_that_never_existed_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvlab.no_such_module")
