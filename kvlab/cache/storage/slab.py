"""Preallocated, contiguous KV caches (the layout gpt-fast's static cache uses, with keys stored key-major):
``ContiguousKVCache``, whose length the host keeps, and ``StaticKVCache``, whose position lives on the device so that
a decode step has static shapes (what a CUDA graph replays, ``kvlab.engine.GraphedDecodeStep``)."""

from __future__ import annotations

import torch

from kvlab.cache.base import (
    FLOAT_DTYPES,
    CacheCapacityError,
    CacheShape,
    KVCache,
    Rotate,
    SlabKVCache,
    kv_codec,
    refuse_latent,
)
from kvlab.cache.codec.stores import Store, attend_stores, make_store
from kvlab.kernels.fused import fused_kernels
from kvlab.kernels.reference import attention_with_probs, window_mask
from kvlab.spec.validation import require_bool, require_int


def _slabs(
    shape: CacheShape, batch_size: int, capacity: int, codec: str, group_size: int = 32, key_major: bool = True
) -> tuple[list[Store], list[Store], int]:
    """One key store (key-major unless ``key_major=False``) and one value store per layer, ``capacity`` slots each,
    and the bytes one token of one layer stores."""
    lead = (batch_size, shape.n_kv_heads)

    def stores(major: bool) -> list[Store]:
        return [
            make_store(codec, lead, capacity, shape.head_dim, shape.torch_dtype, shape.device, major, group_size)
            for _ in range(shape.n_layers)
        ]

    keys, values = stores(key_major), stores(False)
    return keys, values, shape.n_kv_heads * (keys[0].slot_bytes + values[0].slot_bytes)


class ContiguousKVCache(SlabKVCache):
    """One slab per layer, sized for ``capacity`` tokens up front, so a step never reallocates or copies.

    Keys are stored key-major, ``[B, Hkv, D, capacity]``, so decode's ``q @ K`` streams contiguous runs of tokens;
    values are token-major, ``[B, Hkv, capacity, D]``, the layout ``p @ V`` streams best. ``codec`` (default: the
    dtype K/V arrive in) is any of ``kvlab.spec.dtypes.KV_DTYPES``; fp8/int8/int4 store each token's K and V encoded,
    ``group_size`` channels per scale (``kvlab.cache.codec.stores``). A layer's sliding window is applied as it reads.

    ``key_major=False`` keeps float keys token-major like the values, ``[B, Hkv, capacity, D]``: the layout ONNX
    Runtime's attention reads and writes in place, so ``Decoder.new_cache`` picks it under ``runtime="onnx"``
    (``kvlab.model.onnx_step``). PyTorch's ``q @ K`` streams it more slowly. Encoded keys are token-major either way.
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
        key_major: bool = True,
    ) -> None:
        super().__init__(shape, batch_size, capacity)
        refuse_latent(shape, type(self).__name__)
        require_bool("key_major", key_major)
        self.codec = kv_codec(codec, shape)
        self.key_major = key_major
        self._keys, self._values, self._layer_token_bytes = _slabs(
            shape, batch_size, self.capacity, self.codec, group_size, key_major
        )
        self._read_windows: list[int | None] = [None] * shape.n_layers  # as the layers last told them

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._keys[layer].write(self._new_slots, k.transpose(1, 2))
        self._values[layer].write(self._new_slots, v.transpose(1, 2))

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        self._read_windows[layer] = layer_window
        return attend_stores(q, self._keys[layer], self._values[layer], self._length, self._start, layer_window)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys[layer].read(self._length), self._values[layer].read(self._length)

    def slabs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value slabs, every slot, as stored (``[B, Hkv, D, capacity]`` keys when
        key-major, else ``[B, Hkv, capacity, D]``; values ``[B, Hkv, capacity, D]``): for a kernel that writes and
        reads them in place (``kvlab.model.onnx_step``). Float codecs only."""
        if self._keys[layer].encoded:
            raise ValueError(f"codec: {self.codec!r} stores encoded slots; allowed for slabs(): fp32, fp16, bf16")
        return self._keys[layer].data, self._values[layer].data

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V bytes a decode step over ``context`` tokens (default ``length``) reads: a layer that told the cache
        its sliding window reads at most that many tokens."""
        context = self.length if context is None else context
        require_int("context", context, 0)
        tokens = sum(context if w is None else min(context, w) for w in self._read_windows)
        return round(self.batch_size * tokens * self._layer_token_bytes)

    def bytes_allocated(self) -> int:
        return sum(s.nbytes for s in self._keys + self._values)


class StaticKVCache(KVCache):
    """A contiguous slab of ``capacity`` slots whose position lives on the device, so a step has static shapes.

    Keys key-major ``[B, Hkv, D, capacity]``, values ``[B, Hkv, capacity, D]``, in a float ``codec`` (fp32, bf16,
    fp16; default: the dtype K/V arrive in). Every sequence of the batch sits at the same length. ``reserve``
    returns the step's first position as a device ``LongTensor [B]`` (the decoder ropes from it) and advances a
    device counter; the host keeps its own count only to refuse a step past ``capacity``. A layer's sliding window
    is a mask, like the causal one; nothing is sliced.
    """

    _rolls_back = True

    def __init__(
        self, shape: CacheShape, batch_size: int = 1, capacity: int | None = None, *, codec: str | None = None
    ) -> None:
        super().__init__(shape, batch_size, self._required_capacity(capacity, type(self).__name__))
        refuse_latent(shape, type(self).__name__)
        self.codec = kv_codec(codec, shape)
        if self.codec not in FLOAT_DTYPES:
            # An encoded store would decode every slot, all `capacity` of them, into a full-precision copy each step.
            raise ValueError(
                f"codec: {self.codec!r}; allowed: {', '.join(FLOAT_DTYPES)} (for fp8/int8/int4 use ContiguousKVCache)"
            )
        device = shape.device
        self._keys, self._values, self._layer_token_bytes = _slabs(shape, batch_size, self.capacity, self.codec)
        self._slots = torch.arange(self.capacity, device=device)
        self._start = torch.zeros(1, dtype=torch.long, device=device)  # this step's first position
        self._end = torch.zeros(1, dtype=torch.long, device=device)  # positions stored, this step's included
        self._length = 0  # the host's count of the same, for the capacity check and the byte counts
        self._fused = fused_kernels(torch.device(device))

    @property
    def length(self) -> int:
        return self._length

    def claim(self, n_new: int) -> None:
        """The host's half of ``reserve``: refuse a step past ``capacity``, else count its tokens.

        A replayed graph advances the device counter itself; its caller calls only this.
        """
        require_int("n_new", n_new)
        if self._length + n_new > self.capacity:
            raise CacheCapacityError(
                f"KV cache full: {self._length} tokens stored, {n_new} more requested, capacity {self.capacity}. "
                "Create the cache with a larger capacity."
            )
        self._length += n_new

    def reserve(self, n_new: int) -> torch.Tensor:
        self.claim(n_new)
        self._start.copy_(self._end)
        self._end.add_(n_new)
        return self._start.expand(self.batch_size)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``, ``v``: ``[B, T, Hkv, D]``, written at positions ``start .. start + T - 1`` by index."""
        slots = self._start + torch.arange(k.shape[1], device=self._slots.device)
        index = (slice(None), slice(None), slots)
        self._keys[layer].write(index, k.transpose(1, 2))
        self._values[layer].write(index, v.transpose(1, 2))

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        """``q`` ``[B, Hkv, G, T, D]`` over the causal (and windowed) slots: ``[B, Hkv, G, T, D]``.

        A decode step on CUDA runs the fused kernel over the first ``end`` slots, ``end`` read on the device.
        Otherwise every slot is scored and masked: slot ``s`` holds position ``s``, and the mask, ``[T, capacity]``,
        is built on the device from the device start.
        """
        if self._fused is not None and q.shape[-2] == 1:
            lengths = self._end.to(torch.int32).expand(q.shape[0])
            keys, values = self._keys[layer], self._values[layer]
            out = self._fused.decode(q[..., 0, :], keys, values, lengths, window=layer_window)
            return out.unsqueeze(-2)
        queries = self._start + torch.arange(q.shape[-2], device=q.device)
        mask = window_mask(queries, self._slots, layer_window)
        k_t = self._keys[layer].data  # [B, Hkv, D, capacity]: the key-major store itself
        return attention_with_probs(q, k_t, self._values[layer].read(self.capacity), mask)[0]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys[layer].read(self._length), self._values[layer].read(self._length)

    def reset(self) -> None:
        self._forget(0)

    def _forget(self, length: int) -> None:
        # Slots from `length` on keep their bytes; the mask hides them until a step overwrites them.
        self._length = length
        self._end.fill_(length)
        self._start.fill_(length)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V bytes a decode step over ``context`` tokens (default ``length``) reads: those tokens with the fused
        kernel (windows aside), else every one of the ``capacity`` slots, since the step has one shape."""
        context = self.length if context is None else context
        require_int("context", context, 0)
        tokens = context if self._fused is not None else self.capacity
        return round(self.batch_size * tokens * self.bytes_per_token)

    def bytes_allocated(self) -> int:
        return sum(s.nbytes for s in self._keys + self._values)
