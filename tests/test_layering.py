"""The package's layers only point down: each module, imported alone in a fresh interpreter, loads nothing above it.

The order, lowest first (README's layout table says what each module holds):
arithmetic (no torch) -> device, timing -> layers -> kernels -> cache -> attention -> model -> tools built on the
model -> course checkers -> cli. Modules on one level may import each other. A new module must be placed here.
"""

from __future__ import annotations

import fnmatch
import json
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvlab

LEVELS: tuple[tuple[str, ...], ...] = (
    ("kvlab", "kvlab.validation", "kvlab.dtypes", "kvlab.config", "kvlab.presets", "kvlab.published",
     "kvlab.roofline", "kvlab.data"),
    ("kvlab.device", "kvlab.timing", "kvlab.tokenizer", "kvlab.sampling"),
    ("kvlab.layers",),
    ("kvlab.kernels",),
    ("kvlab.cache", "kvlab.cache.*"),
    ("kvlab.attention", "kvlab.mla"),
    ("kvlab.model",),
    ("kvlab.bench", "kvlab.breakdown", "kvlab.engine", "kvlab.quality", "kvlab.session", "kvlab.hf", "kvlab.pretrained",
     "kvlab.speculative", "kvlab.train"),
    ("kvlab.course", "kvlab.course.*", "kvlab.checks"),
    ("kvlab.cli",),
)  # fmt: skip
TORCH_FREE_LEVELS = 1  # the arithmetic: `kvlab predict` and the byte model never wait for torch


def level(module: str) -> int:
    for i, patterns in enumerate(LEVELS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    raise AssertionError(f"{module} has no level in tests/test_layering.py: place it in LEVELS")


MODULES = sorted(
    ["kvlab"] + [m.name for m in pkgutil.walk_packages(kvlab.__path__, "kvlab.") if m.name != "kvlab.__main__"]
)

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps({"kvlab": sorted(m for m in sys.modules if m == "kvlab" or m.startswith("kvlab.")),
                  "torch": "torch" in sys.modules}))
"""


def _loaded(module: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True, text=True, timeout=300)
    if done.returncode:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(MODULES, pool.map(_loaded, MODULES), strict=True))


def test_every_module_has_a_level() -> None:
    for module in MODULES:
        level(module)


@pytest.mark.parametrize("module", MODULES)
def test_module_loads_nothing_above_it(module: str, loaded: dict[str, dict]) -> None:
    assert "error" not in loaded[module], f"import {module} alone failed:\n{loaded[module].get('error')}"
    above = [m for m in loaded[module]["kvlab"] if level(m) > level(module)]
    assert not above, f"importing {module} (level {level(module)}) loaded modules above it: {above}"
    if level(module) < TORCH_FREE_LEVELS:
        assert not loaded[module]["torch"], f"importing {module} loaded torch; the byte model must not need it"


def test_the_check_sees_an_upward_import() -> None:
    """The probe itself: kvlab.checks sits near the top, so importing it must load lower levels (the test
    would pass vacuously if the probe saw no modules)."""
    seen = _loaded("kvlab.checks").get("kvlab", [])
    assert "kvlab.model" in seen and "kvlab.cache.base" in seen
