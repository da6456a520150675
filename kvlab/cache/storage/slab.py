"""A preallocated, contiguous KV cache (the layout gpt-fast's static cache uses, with keys stored key-major)."""

from __future__ import annotations

import torch

from kvlab.cache.base import CacheShape, Rotate, SlabKVCache, kv_codec, refuse_latent
from kvlab.cache.codec.stores import attend_stores, make_store
from kvlab.spec.validation import require_int


class ContiguousKVCache(SlabKVCache):
    """One slab per layer, sized for ``capacity`` tokens up front, so a step never reallocates or copies.

    Keys are stored key-major, ``[B, Hkv, D, capacity]``, so decode's ``q @ K`` streams contiguous runs of tokens;
    values are token-major, ``[B, Hkv, capacity, D]``, the layout ``p @ V`` streams best. ``codec`` (default: the
    dtype K/V arrive in) is any of ``kvlab.spec.dtypes.KV_DTYPES``; fp8/int8/int4 store each token's K and V encoded,
    ``group_size`` channels per scale (``kvlab.cache.codec.stores``). A layer's sliding window is applied as it reads.
    """

    prefill_is_stepwise = True  # every token kept, each encoded on its own

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        codec: str | None = None,
        group_size: int = 32,
    ) -> None:
        super().__init__(shape, batch_size, capacity)
        refuse_latent(shape, type(self).__name__)
        self.codec = kv_codec(codec, shape)
        lead, slots = (batch_size, shape.n_kv_heads), self.capacity
        self._keys = [
            make_store(self.codec, lead, slots, shape.head_dim, shape.torch_dtype, shape.device, True, group_size)
            for _ in range(shape.n_layers)
        ]
        self._values = [
            make_store(self.codec, lead, slots, shape.head_dim, shape.torch_dtype, shape.device, False, group_size)
            for _ in range(shape.n_layers)
        ]
        self._layer_token_bytes = shape.n_kv_heads * (self._keys[0].slot_bytes + self._values[0].slot_bytes)
        self._read_windows: list[int | None] = [None] * shape.n_layers  # as the layers last told them

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._keys[layer].write(self._new_slots, k.transpose(1, 2))
        self._values[layer].write(self._new_slots, v.transpose(1, 2))

    def attend(
        self, layer: int, q: torch.Tensor, window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        self._read_windows[layer] = window
        return attend_stores(q, self._keys[layer], self._values[layer], self._length, self._start, window)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys[layer].read(self._length), self._values[layer].read(self._length)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V bytes a decode step over ``context`` tokens (default ``length``) reads: a layer that told the cache
        its sliding window reads at most that many tokens."""
        context = self.length if context is None else context
        require_int("context", context, 0)
        tokens = sum(context if w is None else min(context, w) for w in self._read_windows)
        return round(self.batch_size * tokens * self._layer_token_bytes)

    def bytes_allocated(self) -> int:
        return sum(s.nbytes for s in self._keys + self._values)
