"""A batch that shares one prompt: its K/V stored once, each sequence's continuation stored on its own.

The paged cache shares a prefix by block id, and its reference kernel gathers blocks into scratch before
attending; on a CPU that copy costs more than the prefix read it saves. This layout keeps the shared prefix in
one contiguous slab and every sequence's suffix in another, so the cascade kernel streams the prefix in place,
once per step for the whole batch::

    cache = SharedPrefixKVCache.for_model(model, batch_size=8, capacity=20_000)
    model.prefill(prompt[None], cache)          # batch of one: the shared prompt
    cache.branch()                              # from here on, batch_size == 8
    logits = model.decode_step(first_tokens, cache)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.cache.base import KVCache
from kvlab.cache.cascade import cascade_decode_attention
from kvlab.cache.contiguous import ContiguousKVCache
from kvlab.kernels import causal_attention
from kvlab.validation import require_int

if TYPE_CHECKING:
    from kvlab.model import Decoder


class SharedPrefixKVCache(KVCache):
    """Until ``branch()``: one sequence, the shared prefix. After: ``batch_size`` sequences continuing it.

    ``capacity`` counts the prefix and one sequence's continuation, like a contiguous cache's.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        capacity: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype = "fp32",
        device: str | torch.device = "cpu",
    ) -> None:
        require_int("batch_size", batch_size)
        self.prefix = ContiguousKVCache(n_layers, 1, capacity, n_kv_heads, head_dim, dtype, device)
        self.n_layers, self.capacity, self.n_kv_heads, self.head_dim = n_layers, capacity, n_kv_heads, head_dim
        self._branch_batch = batch_size
        self.suffix: ContiguousKVCache | None = None

    @classmethod
    def for_model(cls, model: Decoder, batch_size: int, capacity: int) -> SharedPrefixKVCache:
        cfg = model.cfg
        return cls(cfg.n_layers, batch_size, capacity, cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)

    def branch(self) -> None:
        """Freeze the prefix; later tokens are each sequence's own."""
        if self.suffix is not None:
            raise RuntimeError("branch: already branched; call reset() to start a new prefix")
        if self.prefix.length == 0:
            raise RuntimeError("branch: the prefix is empty; prefill the shared prompt first")
        p = self.prefix
        self.suffix = ContiguousKVCache(
            self.n_layers,
            self._branch_batch,
            self.capacity - p.length,
            self.n_kv_heads,
            self.head_dim,
            p.torch_dtype,
            p.device,
        )

    @property
    def _active(self) -> ContiguousKVCache:
        return self.prefix if self.suffix is None else self.suffix

    @property
    def batch_size(self) -> int:
        return self._active.batch_size

    @property
    def length(self) -> int:
        return self.prefix.length + (0 if self.suffix is None else self.suffix.length)

    @property
    def element_bytes(self) -> float:
        return self.prefix.element_bytes

    @property
    def device(self) -> torch.device:
        return self.prefix.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.prefix.torch_dtype

    def reserve(self, n_new: int) -> int:
        offset = 0 if self.suffix is None else self.prefix.length
        return offset + self._active.reserve(n_new)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._active.append(layer, k, v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self.suffix is None:
            return self.prefix.attend(layer, q)
        b, t, h, d = q.shape
        prefix_k, prefix_v = self.prefix.read(layer)
        suffix_k, suffix_v = self.suffix.read(layer)
        if t == 1:
            grouped = (q * self.head_dim**-0.5).view(b, self.n_kv_heads, h // self.n_kv_heads, d)
            out = cascade_decode_attention(
                grouped, prefix_k[0].transpose(-1, -2), prefix_v[0], suffix_k.transpose(-1, -2), suffix_v
            )
            return out.reshape(b, 1, h, d)
        # Several new tokens (a per-sequence prompt after the shared one): attend over prefix + suffix, copied.
        k = torch.cat((prefix_k.expand(b, -1, -1, -1), suffix_k), dim=2)
        v = torch.cat((prefix_v.expand(b, -1, -1, -1), suffix_v), dim=2)
        start = self.length - t
        return causal_attention(q.transpose(1, 2), k, v, q_start=start).transpose(1, 2)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's whole K/V, ``[B, Hkv, S, D]``: a copy, since the prefix exists once."""
        prefix_k, prefix_v = self.prefix.read(layer)
        if self.suffix is None:
            return prefix_k, prefix_v
        suffix_k, suffix_v = self.suffix.read(layer)
        b = self.suffix.batch_size
        return (
            torch.cat((prefix_k.expand(b, -1, -1, -1), suffix_k), dim=2),
            torch.cat((prefix_v.expand(b, -1, -1, -1), suffix_v), dim=2),
        )

    def reset(self) -> None:
        self.prefix.reset()
        self.suffix = None

    def bytes_stored(self) -> int:
        return self.prefix.bytes_stored() + (0 if self.suffix is None else self.suffix.bytes_stored())

    def bytes_allocated(self) -> int:
        return self.prefix.bytes_allocated() + (0 if self.suffix is None else self.suffix.bytes_allocated())

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """The prefix once for the whole batch, plus each sequence's own tokens up to ``context``."""
        context = self.length if context is None else context
        shared = min(context, self.prefix.length)
        return round((shared + self.batch_size * (context - shared)) * self.kv_bytes_per_token)
