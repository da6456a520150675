"""Package surfaces whose names load on first use (PEP 562), so that importing one light module of a package
(``kvlab.engine.scheduler``, ``kvlab.serving.client``) does not import its heavy siblings, or torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose public name ``n`` is defined in module ``exports[n]``."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        """The public names and the submodules loaded so far, not the machinery of this function."""
        loaded = {n for n in vars(sys.modules[package]) if not n.startswith("_") and n != "lazy_exports"}
        return sorted(loaded | set(exports))

    return __getattr__, __dir__
