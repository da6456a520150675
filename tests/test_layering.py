"""The package's layers only point down: each module, imported alone in a fresh interpreter, loads nothing above it.

The order, lowest first (README's layout table says what each module holds):
arithmetic (no torch) -> device, timing -> layers -> kernels -> cache -> attention -> model -> tools built on the
model -> course checkers -> cli. Modules on one level may import each other. A new module must be placed here.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvlab

LEVELS: tuple[tuple[str, ...], ...] = (
    ("kvlab", "kvlab.validation", "kvlab.dtypes", "kvlab.config", "kvlab.presets", "kvlab.published",
     "kvlab.roofline", "kvlab.stats", "kvlab.data"),
    ("kvlab.device", "kvlab.disk_memo", "kvlab.timing", "kvlab.tokenizer", "kvlab.sampling"),
    ("kvlab.layers", "kvlab.weights"),
    ("kvlab.kernels", "kvlab.triton_kernels"),
    ("kvlab.cache", "kvlab.cache.*"),
    ("kvlab.attention", "kvlab.mla"),
    ("kvlab.model",),
    ("kvlab.bench", "kvlab.breakdown", "kvlab.cuda_graphs", "kvlab.endpoint", "kvlab.engine", "kvlab.incident",
     "kvlab.quality", "kvlab.serve", "kvlab.session", "kvlab.hf", "kvlab.pretrained", "kvlab.speculative",
     "kvlab.train"),
    ("kvlab.course", "kvlab.course.*", "kvlab.checks"),
    ("kvlab.cli", "kvlab.report"),
)  # fmt: skip
TORCH_FREE_LEVELS = 1  # the arithmetic: `kvlab predict` and the byte model never wait for torch
OPTIONAL = {"kvlab.triton_kernels": "triton"}  # modules of an extra (kvlab[gpu]): the package each needs


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

# Where fork exists, one interpreter probes every module: a forked child imports one module and reports, so torch
# loads once instead of once per module. The torch-free modules are probed before the parent imports torch, so
# their children show whether they loaded it themselves; the rest inherit torch, whose presence is not checked.
_FORKED_PROBE = """
import importlib, json, os, sys
torch_free, rest = json.loads(sys.argv[1])
found = {}
def probe(module):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            out = {"kvlab": sorted(m for m in sys.modules if m == "kvlab" or m.startswith("kvlab.")),
                   "torch": "torch" in sys.modules}
        except BaseException as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    found[module] = json.loads(b"".join(chunks))
for module in torch_free:
    probe(module)
import torch  # noqa: E402,F401
for module in rest:
    probe(module)
print(json.dumps(found))
"""


def _loaded(module: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True, text=True, timeout=300)
    if done.returncode:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout)


def _loaded_forked(torch_free: list[str], rest: list[str]) -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, "-c", _FORKED_PROBE, json.dumps([torch_free, rest])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    if hasattr(os, "fork"):
        low = [m for m in MODULES if level(m) < TORCH_FREE_LEVELS]
        return _loaded_forked(low, [m for m in MODULES if m not in low])
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(MODULES, pool.map(_loaded, MODULES), strict=True))


def test_every_module_has_a_level() -> None:
    for module in MODULES:
        level(module)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.slow
def test_module_loads_nothing_above_it(module: str, loaded: dict[str, dict]) -> None:
    if module in OPTIONAL and importlib.util.find_spec(OPTIONAL[module]) is None:
        pytest.skip(f"{module} needs {OPTIONAL[module]}, which is not installed (pip install 'kvlab[gpu]')")
    assert "error" not in loaded[module], f"import {module} alone failed:\n{loaded[module].get('error')}"
    above = [m for m in loaded[module]["kvlab"] if level(m) > level(module)]
    assert not above, f"importing {module} (level {level(module)}) loaded modules above it: {above}"
    if level(module) < TORCH_FREE_LEVELS:
        assert not loaded[module]["torch"], f"importing {module} loaded torch; the byte model must not need it"


@pytest.mark.slow
def test_the_check_sees_an_upward_import() -> None:
    """The probe itself: kvlab.checks sits near the top, so importing it must load lower levels (the test
    would pass vacuously if the probe saw no modules)."""
    seen = _loaded("kvlab.checks").get("kvlab", [])
    assert "kvlab.model" in seen and "kvlab.cache.base" in seen
    if hasattr(os, "fork"):  # the forked probe too, and its torch flag for a module probed before torch loads
        forked = _loaded_forked(["kvlab.model"], ["kvlab.checks"])
        assert "kvlab.cache.base" in forked["kvlab.checks"]["kvlab"] and forked["kvlab.model"]["torch"]
