"""What a model and a machine are, torch-free: model configs (``ModelConfig``, ``MLAConfig``, ``MoEConfig``), the named
model and GPU presets with their sources, the published decode and speculative measurements, the dtype table (names,
bytes per element, KV codecs), and the argument checks every layer uses."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "BYTES_PER_ELEMENT": "kvlab.spec.dtypes",
    "FractionRange": "kvlab.spec.published",
    "GPU": "kvlab.spec.presets",
    "GROUP_STAT_BYTES": "kvlab.spec.dtypes",
    "HARDWARE_CLASSES": "kvlab.spec.published",
    "KV_DTYPES": "kvlab.spec.dtypes",
    "KV_GROUP_STATS": "kvlab.spec.dtypes",
    "MLAConfig": "kvlab.spec.config",
    "MoEConfig": "kvlab.spec.config",
    "ModelConfig": "kvlab.spec.config",
    "PublishedDecode": "kvlab.spec.published",
    "QUANTIZED_BYTES_PER_PARAM": "kvlab.spec.published",
    "SinksAndWindow": "kvlab.spec.keep",
    "WEIGHT_COMPONENTS": "kvlab.spec.config",
    "bandwidth_fraction_range": "kvlab.spec.published",
    "canonical_dtype": "kvlab.spec.dtypes",
    "draft_of": "kvlab.spec.presets",
    "draft_presets": "kvlab.spec.presets",
    "get_gpu": "kvlab.spec.presets",
    "get_model": "kvlab.spec.presets",
    "gpu_presets": "kvlab.spec.presets",
    "matching_fraction_range": "kvlab.spec.published",
    "model_presets": "kvlab.spec.presets",
    "params_verified": "kvlab.spec.presets",
    "published_decode": "kvlab.spec.published",
    "published_speculative": "kvlab.spec.published",
    "require_bool": "kvlab.spec.validation",
    "require_fraction": "kvlab.spec.validation",
    "require_int": "kvlab.spec.validation",
    "require_number": "kvlab.spec.validation",
    "same_vocabulary": "kvlab.spec.presets",
    "served_context": "kvlab.spec.presets",
    "to_torch": "kvlab.spec.dtypes",
    "tokenizer_of": "kvlab.spec.presets",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
