"""The module paths kvlab had before its packages (``kvlab.bench``, ``kvlab.timing``, ``kvlab.cache.paged``, ...),
still importable for one release so that a learner's notebook or a submission written against them keeps running.
Each old path is served by the modules that now hold its names; nothing is printed, since nbgrader zeroes a cell
that writes to stderr. New code imports from the package surfaces (README's layout table)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

# old module path -> the modules that now define its names, searched in order
MOVED: dict[str, tuple[str, ...]] = {
    "kvlab.attention": ("kvlab.model.attention",),
    "kvlab.bench": ("kvlab.measure.sweep", "kvlab.metrics"),
    "kvlab.breakdown": ("kvlab.measure.step_time",),
    "kvlab.cache.block_pool": ("kvlab.cache.storage.block_pool",),
    "kvlab.cache.codecs": ("kvlab.cache.codec.codecs",),
    "kvlab.cache.contiguous": ("kvlab.cache.storage.slab",),
    "kvlab.cache.heavy_hitters": ("kvlab.cache.policy.heavy_hitters",),
    "kvlab.cache.latent": ("kvlab.cache.storage.latent",),
    "kvlab.cache.paged": ("kvlab.cache.storage.paged",),
    "kvlab.cache.policies": ("kvlab.cache.policy.slots",),
    "kvlab.cache.quantized": ("kvlab.cache.codec.kivi", "kvlab.kernels.int8"),
    "kvlab.cache.shared_prefix": ("kvlab.cache.storage.shared_prefix",),
    "kvlab.cache.stores": ("kvlab.cache.codec.stores",),
    "kvlab.cache.window": ("kvlab.cache.policy.window",),
    "kvlab.config": ("kvlab.spec.config",),
    "kvlab.cuda_graphs": ("kvlab.engine.cuda_graphs",),
    "kvlab.device": ("kvlab.machine.device",),
    "kvlab.disk_memo": ("kvlab.course.disk_memo",),
    "kvlab.dtypes": ("kvlab.spec.dtypes",),
    "kvlab.endpoint": ("kvlab.serving.client",),
    "kvlab.hf": ("kvlab.model.hf",),
    "kvlab.incident": ("kvlab.course.incident",),
    "kvlab.layers": ("kvlab.model.layers",),
    "kvlab.mla": ("kvlab.model.mla",),
    "kvlab.presets": ("kvlab.spec.presets",),
    "kvlab.pretrained": ("kvlab.model.pretrained",),
    "kvlab.published": ("kvlab.spec.published",),
    "kvlab.quality": ("kvlab.measure.quality",),
    "kvlab.sampling": ("kvlab.model.sampling",),
    "kvlab.serve": ("kvlab.serving.server",),
    "kvlab.session": ("kvlab.measure.session",),
    "kvlab.speculative": ("kvlab.engine.speculative",),
    "kvlab.stats": ("kvlab.metrics",),
    "kvlab.timing": ("kvlab.machine.timing",),
    "kvlab.tokenizer": ("kvlab.model.tokenizer",),
    "kvlab.train": ("kvlab.measure.train",),
    "kvlab.triton_kernels": ("kvlab.kernels.triton",),
    "kvlab.validation": ("kvlab.spec.validation",),
    "kvlab.weights": ("kvlab.model.weights",),
}
# names that changed with the move: old path -> {old name: new name}
RENAMED: dict[str, dict[str, str]] = {"kvlab.breakdown": {"report": "breakdown_table"}}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: asked only for a name no real module has."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        for new in reversed(MOVED[module.__name__]):  # the first module listed wins a name both define
            module.__dict__.update({k: v for k, v in vars(importlib.import_module(new)).items() if k[:2] != "__"})
        for old, new_name in RENAMED.get(module.__name__, {}).items():
            setattr(module, old, getattr(module, new_name))


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
