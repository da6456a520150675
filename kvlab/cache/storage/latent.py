"""MLA's cache: one latent per token and layer, ``[c_kv | k_rope]``, stored once and read as both K and V.

Seen from a cache, multi-head latent attention (``kvlab.model.mla``) is multi-query attention with one shared head whose
key is the latent (``r + p`` wide) and whose value is that key's first ``r`` channels (``CacheShape.latent_values``).
So the storage is one token-major store per layer, and ``attend`` is the same slab attention an MQA cache runs,
with the values taken as a view of the keys.
"""

from __future__ import annotations

import torch

from kvlab.cache.base import CacheShape, Rotate, SlabKVCache, check_latent_value, kv_codec, refuse_window
from kvlab.cache.codec.stores import attend_stores, make_store


class LatentKVCache(SlabKVCache):
    """Per layer and token, the latent ``[c_kv | k_rope]``: ``D = r + p`` elements, nothing per head.

    The ``KVCache`` calls keep their meaning in the multi-query view (``Hkv = 1``, ``Dv = r``):

    - ``append(layer, k, v)``: ``k`` ``[B, T, 1, r + p]`` is ``[c_kv | k_rope]`` (RoPE applied); ``v`` must be
      ``k[..., :r]``, the same bytes, which are stored once.
    - ``attend(layer, q)``: ``q`` ``[B, 1, H, T, r + p]``, queries folded into latent space and scaled by
      ``kvlab.model.mla.MLAAttention`` -> ``[B, 1, H, T, r]``, each head's softmax-weighted sum of latents.
    - ``read(layer)``: ``[B, 1, S, r + p]`` and ``[B, 1, S, r]``, the second a view of the first.

    Token-major: the one store is both K and V, so it cannot be key-major for the scores and token-major for the
    weighted sum at once (every head scores against the same latent, so ``q @ K`` is a matrix product here, not the
    matrix-vector product that key-major storage sped up for MHA). ``codec`` (default: the dtype the latents arrive
    in) is any of ``kvlab.spec.dtypes.KV_DTYPES``; fp8/int8/int4 encode each latent on its own, ``group_size`` channels
    per scale (``kvlab.cache.codec.stores``). Byte methods count each latent once, as
    ``kvlab.roofline.kv_bytes_per_token`` does for MLA; this unfused kernel streams ``c_kv`` twice a step (scores,
    then the weighted sum), a fused one once. A window + sinks over latents is ``WindowKVCache`` on the same shape.
    """

    prefill_is_stepwise = True  # every latent kept, each encoded on its own

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        codec: str | None = None,
        group_size: int = 32,
    ) -> None:
        if shape.latent_values is None:
            raise ValueError(
                f"shape: {shape} has no latent_values; allowed: an MLA latent's shape (CacheShape.from_config(an MLA "
                "config), or CacheShape(n_layers, 1, r + p, latent_values=r))"
            )
        super().__init__(shape, batch_size, capacity)
        self.codec = kv_codec(codec, shape)
        lead, dim = (batch_size, 1), shape.head_dim
        self._latents = [
            make_store(self.codec, lead, self.capacity, dim, shape.torch_dtype, shape.device, group_size=group_size)
            for _ in range(shape.n_layers)
        ]
        self._layer_token_bytes = self._latents[0].slot_bytes

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        check_latent_value(self.shape, k, v)
        self._latents[layer].write(self._new_slots, k.transpose(1, 2))

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        fix = "kvlab has no MLA model with sliding-window layers; attend globally"
        refuse_window(layer_window, "LatentKVCache", fix)
        store, r = self._latents[layer], self.shape.latent_values
        return attend_stores(q, store, None, self._length, self._start, value_dim=r)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._latents[layer].read(self._length)
        return k, k[..., : self.shape.latent_values]
