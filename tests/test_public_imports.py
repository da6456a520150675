"""The notebooks (lessons, their solutions, the appendix) import kvlab only through its public surfaces: ``kvlab``,
``kvlab.checks``, ``kvlab.metrics`` and the packages' ``__init__`` (README's layout table), never a module inside a
package, so the learners' API is not the file layout."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for folder in ("solutions", "lessons", "appendix") for p in (ROOT / folder).rglob("*.ipynb"))


def _is_public(module: str) -> bool:
    if module in ("kvlab", "kvlab.checks", "kvlab.metrics"):  # the top-level modules that are a surface
        return True
    spec = importlib.util.find_spec(module) if module.count(".") == 1 else None
    return spec is not None and spec.submodule_search_locations is not None  # a package: kvlab.cache, kvlab.model


def _kvlab_imports(notebook: Path) -> list[str]:
    found = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and not node.level:
                found.append(node.module)
            elif isinstance(node, ast.Import):
                found += [a.name for a in node.names]
    return [m for m in found if m == "kvlab" or m.startswith("kvlab.")]


def test_the_notebooks_are_found() -> None:
    assert len(NOTEBOOKS) >= 24  # 12 lessons and their 12 solutions, and the appendix


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_notebook_imports_only_public_surfaces(notebook: Path) -> None:
    private = sorted({m for m in _kvlab_imports(notebook) if not _is_public(m)})
    assert not private, f"{notebook.name} imports module paths, not package surfaces: {private}"
