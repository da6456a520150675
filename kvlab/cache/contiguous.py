"""A preallocated, contiguous KV cache (the layout gpt-fast's static cache uses, with keys stored key-major)."""

from __future__ import annotations

import math

import torch

from kvlab.cache.base import KVCache
from kvlab.dtypes import canonical_dtype, torch_dtype
from kvlab.kernels import causal_attention, decode_attention
from kvlab.validation import require_int


class ContiguousKVCache(KVCache):
    """One slab per layer, sized for ``capacity`` tokens up front, so a step never reallocates or copies.

    Keys are stored key-major, ``[B, Hkv, D, capacity]``, so decode's ``q @ K`` streams contiguous runs of tokens;
    values are token-major, ``[B, Hkv, capacity, D]``, the layout ``p @ V`` streams best.
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
        for name, value in (
            ("n_layers", n_layers),
            ("batch_size", batch_size),
            ("capacity", capacity),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            require_int(name, value)
        self.n_layers, self.batch_size, self.capacity = n_layers, batch_size, capacity
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.dtype_name = canonical_dtype(dtype, "kv dtype", allowed=("fp32", "fp16", "bf16"))
        tdtype = torch_dtype(self.dtype_name)
        self._k_t = torch.zeros(n_layers, batch_size, n_kv_heads, head_dim, capacity, dtype=tdtype, device=device)
        self._v = torch.zeros(n_layers, batch_size, n_kv_heads, capacity, head_dim, dtype=tdtype, device=device)
        # Per-layer views, made once: indexing a tensor in the hot loop costs microseconds per layer.
        self._k_layers = list(self._k_t.unbind(0))
        self._v_layers = list(self._v.unbind(0))
        self._scale = 1.0 / math.sqrt(head_dim)
        self._length = 0
        self._start = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def element_bytes(self) -> float:
        return self._k_t.element_size()

    @property
    def device(self) -> torch.device:
        return self._k_t.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return self._k_t.dtype

    def reserve(self, n_new: int) -> int:
        return self._claim_slots(n_new)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = self._length
        self._k_layers[layer][..., self._start : end] = k.permute(0, 2, 3, 1)
        self._v_layers[layer][:, :, self._start : end] = v.transpose(1, 2)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, t, h, d = q.shape
        end = self._length
        k_t = self._k_layers[layer][..., :end]
        v = self._v_layers[layer][:, :, :end]
        if t == 1:
            out = decode_attention((q * self._scale).view(b, self.n_kv_heads, h // self.n_kv_heads, d), k_t, v)
            return out.view(b, 1, h, d)
        out = causal_attention(q.transpose(1, 2), k_t.transpose(-1, -2), v, q_start=self._start)
        return out.transpose(1, 2)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length
        return self._k_layers[layer][..., :end].transpose(-1, -2), self._v_layers[layer][:, :, :end]

    def reset(self) -> None:
        self._length = 0
        self._start = 0
