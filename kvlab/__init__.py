"""kvlab: measure why LLM decoding slows down as the context grows, and what each fix buys.

The public names load on first use (PEP 562), so that ``import kvlab.roofline.bytes`` or ``kvlab predict`` never pays
for torch: ``from kvlab import Decoder`` imports the model then, and only then.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "CacheCapacityError": "kvlab.cache.base",
    "ContiguousKVCache": "kvlab.cache.storage.slab",
    "Decoder": "kvlab.model.decoder",
    "KVCache": "kvlab.cache.base",
    "MLAConfig": "kvlab.spec.config",
    "ModelConfig": "kvlab.spec.config",
    "default_device": "kvlab.machine.device",
    "from_hf": "kvlab.model.hf",
    "get_gpu": "kvlab.spec.presets",
    "get_model": "kvlab.spec.presets",
    "gpu_presets": "kvlab.spec.presets",
    "list_pretrained": "kvlab.model.pretrained",
    "load_pretrained": "kvlab.model.pretrained",
    "model_presets": "kvlab.spec.presets",
    "save_hf": "kvlab.model.hf",
    "to_hf": "kvlab.model.hf",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
