"""kvlab: measure why LLM decoding slows down as the context grows, and what each fix buys.

The public names load on first use (PEP 562), so that ``import kvlab.roofline`` or ``kvlab predict`` never pays
for torch: ``from kvlab import Decoder`` imports the model then, and only then. Each package (``kvlab.spec``,
``kvlab.roofline``, ``kvlab.cache``, ``kvlab.model``, ``kvlab.engine``, ``kvlab.measure``, ...) has its public
surface in its ``__init__``; the README's layout table lists them, lowest layer first.
"""

from __future__ import annotations

from kvlab import _moved
from kvlab._lazy import lazy_exports

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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
_moved.install()  # the module paths of the previous release, for notebooks written against them
