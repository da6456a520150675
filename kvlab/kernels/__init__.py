"""Attention math that knows no cache and no model: the torch reference kernels (decode, causal, windowed masks,
partial attention and its merge, online softmax, cascade), int8 scores and scale-folded values over integer codes,
and the fused Triton decode kernels (``kvlab.kernels.triton``, CUDA with ``kvlab[gpu]``), which the caches pick per
device."""

from kvlab._lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "fused_kernels": "kvlab.kernels.fused",
    "MAX_SCORES": "kvlab.kernels.reference",
    "attend_slab": "kvlab.kernels.reference",
    "attention_with_probs": "kvlab.kernels.reference",
    "cascade_decode_attention": "kvlab.kernels.reference",
    "causal_attention": "kvlab.kernels.reference",
    "decode_attention": "kvlab.kernels.reference",
    "folded_value_product": "kvlab.kernels.int8",
    "int8_key_scores": "kvlab.kernels.int8",
    "merge_partials": "kvlab.kernels.reference",
    "online_softmax_attention": "kvlab.kernels.reference",
    "partial_attention": "kvlab.kernels.reference",
    "window_mask": "kvlab.kernels.reference",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
