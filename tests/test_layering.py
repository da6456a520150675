"""The package's layers only point down, one package per layer.

Lowest first (the README's layout table, generated from each package's docstring, says what each holds):
spec (no torch) -> roofline, metrics (no torch) -> machine -> kernels -> cache -> model -> engine -> measure ->
serving -> course, checks -> report -> cli. Modules of one package may import each other; a module never imports
a package above its own, not even inside a function or under ``TYPE_CHECKING`` (a cycle a reader must still hold
in their head), and nothing imports ``kvlab.cli``. Imported alone in a fresh interpreter, each module loads nothing
above it, and the torch-free ones load no torch. A new package must be placed here.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

import kvlab

LEVELS: tuple[tuple[str, ...], ...] = (
    ("kvlab", "kvlab._lazy", "kvlab._moved", "kvlab.data", "kvlab.spec", "kvlab.spec.*"),  # _moved: old paths (shims)
    ("kvlab.roofline", "kvlab.roofline.*", "kvlab.metrics"),
    ("kvlab.machine", "kvlab.machine.*"),
    ("kvlab.kernels", "kvlab.kernels.*"),
    ("kvlab.cache", "kvlab.cache.*"),
    ("kvlab.model", "kvlab.model.*"),
    ("kvlab.engine", "kvlab.engine.*"),
    ("kvlab.measure", "kvlab.measure.*"),
    ("kvlab.serving", "kvlab.serving.*"),
    ("kvlab.course", "kvlab.course.*", "kvlab.checks"),
    ("kvlab.report", "kvlab.report.*"),
    ("kvlab.cli",),
)
TORCH_FREE_LEVELS = 2  # the arithmetic: `kvlab predict` and the byte model never wait for torch
# Modules above those levels that must load no torch either: a client for someone else's server, the report, and
# the engine's planning half.
TORCH_FREE = {
    "kvlab.engine",
    "kvlab.engine.clock",
    "kvlab.engine.scheduler",  # the capstone replays at scale on these two alone
    "kvlab.report",
    "kvlab.report.build",
    "kvlab.report.render",
    "kvlab.serving",
    "kvlab.serving.client",
}
OPTIONAL = {"kvlab.kernels.triton": "triton"}  # modules of an extra (kvlab[gpu]): the package each needs


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
        low = [m for m in MODULES if level(m) < TORCH_FREE_LEVELS or m in TORCH_FREE]
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
    if level(module) < TORCH_FREE_LEVELS or module in TORCH_FREE:
        assert not loaded[module]["torch"], f"importing {module} loaded torch; it must not need it"


@pytest.mark.slow
def test_the_check_sees_an_upward_import() -> None:
    """The probe itself: kvlab.checks sits near the top, so importing it must load lower levels (the test
    would pass vacuously if the probe saw no modules)."""
    seen = _loaded("kvlab.checks").get("kvlab", [])
    assert "kvlab.model.decoder" in seen and "kvlab.cache.base" in seen
    if hasattr(os, "fork"):  # the forked probe too, and its torch flag for a module probed before torch loads
        forked = _loaded_forked(["kvlab.model.decoder"], ["kvlab.checks"])
        assert "kvlab.cache.base" in forked["kvlab.checks"]["kvlab"] and forked["kvlab.model.decoder"]["torch"]


@cache  # four tests ask for every module's imports
def _imports_anywhere(module: str) -> frozenset[str]:
    """Every kvlab module ``module``'s source names in an import: at the top, inside a function, under
    ``TYPE_CHECKING``. The probe above sees only what loads at import time; a cycle hidden in a function body or a
    type annotation is still a cycle a reader must hold in their head."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from kvlab.cache import paged` imports a module; `from kvlab.cache import KVCache` a name of the package
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return frozenset(m for m in found if m == "kvlab" or m.startswith("kvlab."))


def _package(module: str) -> str:
    """The layer's package a module belongs to: ``kvlab.cache.storage.paged`` -> ``kvlab.cache``."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("module", MODULES)
def test_no_import_points_up_even_inside_a_function(module: str) -> None:
    above = sorted(m for m in _imports_anywhere(module) if level(m) > level(module))
    assert not above, f"{module} (level {level(module)}) imports modules above it: {above}"


def test_packages_import_each_other_without_a_cycle() -> None:
    """Package A imports package B (anywhere in any module) only if B sits on a lower level, so no two packages
    import each other, and no two packages share a level unless neither imports the other."""
    edges = {(_package(m), _package(d)) for m in MODULES for d in _imports_anywhere(m)}
    cycles = sorted((a, b) for a, b in edges if a != b and (b, a) in edges)
    assert not cycles, f"packages that import each other: {cycles}"


@pytest.mark.parametrize("package", sorted({_package(m) for m in MODULES if m.count(".") >= 1} - {"kvlab.cli"}))
def test_a_package_surface_exports_only_its_own_modules(package: str) -> None:
    exports = getattr(importlib.import_module(package), "_EXPORTS", {})
    strangers = sorted(n for n, m in exports.items() if _package(m) != package)
    assert not strangers, f"{package}.__init__ exports names of other packages: {strangers}"
    missing = sorted(
        set(getattr(importlib.import_module(package), "__all__", ())) - set(dir(importlib.import_module(package)))
    )
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("module", [m for m in MODULES if m != "kvlab.cli"])
def test_nothing_imports_the_command_line(module: str) -> None:
    assert "kvlab.cli" not in _imports_anywhere(module), f"{module} imports kvlab.cli: move what it needs below it"


def test_modules_import_each_other_without_a_cycle() -> None:
    """Inside a package too: following imports (anywhere in a module) from any module never leads back to it."""
    graph = {m: _imports_anywhere(m) - {m} for m in MODULES}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError(f"an import cycle: {' -> '.join(path[path.index(module) :] + (module,))}")
        if module in done:
            return
        for dependency in sorted(graph.get(module, ())):
            visit(dependency, (*path, module))
        done.add(module)

    for module in MODULES:
        visit(module, ())
