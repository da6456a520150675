"""kvlab: measure why LLM decoding slows down as the context grows, and what each fix buys."""

from kvlab.config import MLAConfig, ModelConfig
from kvlab.presets import get_gpu, get_model, gpu_presets, model_presets

__all__ = ["MLAConfig", "ModelConfig", "get_gpu", "get_model", "gpu_presets", "model_presets"]
