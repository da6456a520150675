"""kvlab: measure why LLM decoding slows down as the context grows, and what each fix buys."""

from kvlab.cache import CacheCapacityError, ContiguousKVCache, KVCache
from kvlab.config import MLAConfig, ModelConfig
from kvlab.device import default_device
from kvlab.hf import from_hf, save_hf, to_hf
from kvlab.model import Decoder
from kvlab.presets import get_gpu, get_model, gpu_presets, model_presets
from kvlab.pretrained import list_pretrained, load_pretrained

__all__ = [
    "CacheCapacityError",
    "ContiguousKVCache",
    "Decoder",
    "KVCache",
    "MLAConfig",
    "ModelConfig",
    "default_device",
    "from_hf",
    "get_gpu",
    "get_model",
    "gpu_presets",
    "list_pretrained",
    "load_pretrained",
    "model_presets",
    "save_hf",
    "to_hf",
]
