"""A batch that shares one prompt: its K/V stored once, each sequence's continuation stored on its own.

The paged cache shares a prefix by block id, and its reference kernel gathers blocks into scratch before
attending; on a CPU that copy costs more than the prefix read it saves. This layout keeps the shared prefix in
one contiguous slab and every sequence's suffix in another, so the cascade kernel streams the prefix in place,
once per step for the whole batch::

    cache = SharedPrefixKVCache.for_model(model, batch_size=8, capacity=20_000)
    model.prefill(prompt[None], cache)          # batch of one: the shared prompt
    cache.branch()                              # from here on, batch_size == 8
    logits = model.decode_step(first_tokens, cache)

Both slabs are ``ContiguousKVCache`` s, so any codec works; with fp8/int8/int4 a step decodes the slabs it reads
into full-precision scratch (``read``) before the cascade kernel, rather than streaming them chunk by chunk.
"""

from __future__ import annotations

import torch

from kvlab.cache.base import CacheShape, KVCache, Rotate
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.kernels.reference import attend_slab, cascade_decode_attention
from kvlab.spec.validation import require_int


class SharedPrefixKVCache(KVCache):
    """Until ``branch()``: one sequence, the shared prefix. After: ``batch_size`` sequences continuing it.

    ``capacity`` counts the prefix and one sequence's continuation, like a contiguous cache's. ``batch_size`` is 1
    until ``branch()``. ``codec`` and ``group_size`` are ``ContiguousKVCache``'s, for both slabs.
    """

    _rolls_back = True

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        codec: str | None = None,
        group_size: int = 32,
    ) -> None:
        super().__init__(shape, batch_size, self._required_capacity(capacity, "SharedPrefixKVCache"))
        self._options = dict(codec=codec, group_size=group_size)
        self.prefix = ContiguousKVCache(shape, 1, self.capacity, **self._options)
        self.codec = self.prefix.codec
        self._layer_token_bytes = self.prefix.bytes_per_token / shape.n_layers
        self._branch_batch = batch_size
        self._read_windows: list[int | None] = [None] * shape.n_layers  # as the layers last told them
        self.suffix: ContiguousKVCache | None = None
        self.batch_size = 1

    def branch(self) -> None:
        """Freeze the prefix; later tokens are each sequence's own."""
        if self.suffix is not None:
            raise RuntimeError("branch: already branched; call reset() to start a new prefix")
        if self.prefix.length == 0:
            raise RuntimeError("branch: the prefix is empty; prefill the shared prompt first")
        if self.prefix.length == self.capacity:
            raise RuntimeError(f"branch: the prefix fills the capacity ({self.capacity}); build a larger cache")
        room = self.capacity - self.prefix.length
        self.suffix = ContiguousKVCache(self.shape, self._branch_batch, room, **self._options)
        self.batch_size = self._branch_batch

    @property
    def _active(self) -> ContiguousKVCache:
        return self.prefix if self.suffix is None else self.suffix

    @property
    def length(self) -> int:
        return self.prefix.length + (0 if self.suffix is None else self.suffix.length)

    def reserve(self, n_new: int) -> int:
        offset = 0 if self.suffix is None else self.prefix.length
        return offset + self._active.reserve(n_new)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._active.append(layer, k, v)

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        self._read_windows[layer] = layer_window
        if self.suffix is None:
            return self.prefix.attend(layer, q, layer_window)
        if q.shape[-2] > 1:
            # Several new tokens (a per-sequence prompt after the shared one): attend over prefix + suffix, copied.
            k, v = self.read(layer)
            return attend_slab(q, k.transpose(-1, -2), v, self.length - q.shape[-2], layer_window)
        # Decode: the prefix tokens the layer's window reaches, read once for the batch, merged with each suffix's.
        n_prefix = self.prefix.length
        first = 0 if layer_window is None else max(0, self.length - layer_window)
        prefix_k, prefix_v = (x[0, :, min(first, n_prefix) :] for x in self.prefix.read(layer))
        suffix_k, suffix_v = (x[:, :, max(0, first - n_prefix) :] for x in self.suffix.read(layer))
        out = cascade_decode_attention(
            q[..., 0, :], prefix_k.transpose(-1, -2), prefix_v, suffix_k.transpose(-1, -2), suffix_v
        )
        return out.unsqueeze(-2)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's whole K/V, ``[B, Hkv, S, D]``: a copy once branched, since the prefix exists once."""
        prefix_k, prefix_v = self.prefix.read(layer)
        if self.suffix is None:
            return prefix_k, prefix_v
        suffix_k, suffix_v = self.suffix.read(layer)
        b = self.suffix.batch_size
        return (
            torch.cat((prefix_k.expand(b, -1, -1, -1), suffix_k), dim=2),
            torch.cat((prefix_v.expand(b, -1, -1, -1), suffix_v), dim=2),
        )

    @property
    def max_rollback(self) -> int:
        """The branch's own tokens once branched (the prefix is shared, frozen); the prefix's before."""
        return self._active.max_rollback

    def _forget(self, length: int) -> None:
        self._active.truncate(length - (0 if self.suffix is None else self.prefix.length))

    def reset(self) -> None:
        self.prefix.reset()
        self.suffix = None
        self.batch_size = 1

    def bytes_stored(self) -> int:
        return self.prefix.bytes_stored() + (0 if self.suffix is None else self.suffix.bytes_stored())

    def bytes_allocated(self) -> int:
        return self.prefix.bytes_allocated() + (0 if self.suffix is None else self.suffix.bytes_allocated())

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """The prefix once for the whole batch, plus each sequence's own tokens, up to ``context`` (default
        ``length``); a layer that told the cache its sliding window reads only the tokens in it."""
        context = self.length if context is None else context
        require_int("context", context, 0)
        shared_end = min(context, self.prefix.length)
        tokens = 0
        for window in self._read_windows:
            first = 0 if window is None else max(0, context - window)
            tokens += max(0, shared_end - first) + self.batch_size * (context - max(first, shared_end))
        return round(tokens * self._layer_token_bytes)
