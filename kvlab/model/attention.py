"""Multi-head attention with grouped KV heads (MHA, GQA or MQA, by ``n_kv_heads``): the model's rules live here.

This module owns what the model decides about attention: the softmax scale, which query heads share a KV head,
each layer's sliding window, and RoPE. It hands a cache queries already scaled and grouped, ``[B, Hkv, G, T, D]``
(G = n_heads / n_kv_heads), tells it the layer's window, and lends it ``rotate`` for a cache that must score some
keys at positions other than the query's own. The cache only stores and reads K/V (``kvlab.cache``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from kvlab.cache.base import KVCache
from kvlab.kernels.reference import causal_attention
from kvlab.model.layers import RotaryEmbedding, apply_rope
from kvlab.model.weights import WeightFormat
from kvlab.spec.config import ModelConfig


class Attention(nn.Module):
    """One layer's attention: ``x`` ``[B, T, d_model]`` -> ``[B, T, d_model]``, with a cache or without one."""

    def __init__(self, cfg: ModelConfig, layer: int, weights: WeightFormat | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.weights = WeightFormat() if weights is None else weights
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.layer_window = cfg.layer_windows[layer] if cfg.layer_windows else None
        self.scale = cfg.head_dim**-0.5
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Parameter(torch.empty(cfg.d_model, q_dim + 2 * kv_dim))  # [in, q | k | v]
        self.wo = nn.Parameter(torch.empty(q_dim, cfg.d_model))

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        """``cos``, ``sin``: ``[T, 1, D]`` for the new positions. Without a cache, attends causally within ``x``."""
        return self.output(self.attend(*self.project(x, cos, sin), rope, cache))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[B, T, d_model]`` -> the scaled, grouped queries ``[B, Hkv, G, T, D]`` and the new keys and values
        ``[B, T, Hkv, D]``, queries and keys roped (``cos``, ``sin``: ``[T, 1, D]``, or ``[B, T, 1, D]``)."""
        b, t, _ = x.shape
        qk_heads = self.n_heads + self.n_kv_heads
        qkv = self.weights.matmul(x, self.wqkv).view(b, t, qk_heads + self.n_kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :, :qk_heads], cos, sin)
        q, k, v = qk[:, :, : self.n_heads], qk[:, :, self.n_heads :], qkv[:, :, qk_heads:]
        return group_queries(q, self.n_kv_heads, self.scale), k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RotaryEmbedding, cache: KVCache | None
    ) -> torch.Tensor:
        """``project``'s outputs -> ``[B, Hkv, G, T, D]``: through ``cache`` (which stores ``k``, ``v`` first), or
        causally within the new tokens without one."""
        if cache is None:
            return causal_attention(q, k.transpose(1, 2), v.transpose(1, 2), 0, self.layer_window)
        cache.append(self.layer, k, v)
        return cache.attend(self.layer, q, self.layer_window, functools.partial(rotated, q, rope))

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """``attend``'s ``[B, Hkv, G, T, D]`` -> the output projection ``[B, T, d_model]``."""
        return self.weights.matmul(ungroup(attended), self.wo)


def group_queries(q: torch.Tensor, n_kv_heads: int, scale: float) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[B, Hkv, G, T, D]`` times ``scale``: the G query heads that share each KV head.

    Head ``h`` reads KV head ``h // G``, as in Llama's ``repeat_kv``. For one token (decode) this is a view.
    """
    b, t, h, d = q.shape
    if t == 1:  # [B, 1, H, D] is already laid out as [B, Hkv, G, 1, D]: one view, no transpose
        return (q * scale).view(b, n_kv_heads, h // n_kv_heads, 1, d)
    return (q * scale).transpose(1, 2).view(b, n_kv_heads, h // n_kv_heads, t, d)


def ungroup(out: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, G, T, Dv]`` -> ``[B, T, H * Dv]``, the input of the output projection."""
    b, hkv, g, t, dv = out.shape
    if t == 1:  # a decode step's [B, Hkv, G, 1, Dv] is already in head order
        return out.reshape(b, 1, hkv * g * dv)
    return out.reshape(b, hkv * g, t, dv).transpose(1, 2).reshape(b, t, hkv * g * dv)


def rotated(q: torch.Tensor, rope: RotaryEmbedding, shift: torch.Tensor) -> torch.Tensor:
    """``q`` (``[..., T, D]``) rotated by RoPE through ``shift`` (``[T]``) more positions.

    RoPE is a rotation by an angle proportional to the position, so ``rope(q, a + s) = rotate(rope(q, a), s)``:
    a query roped at its own position can be moved to another without recomputing it.
    """
    cos, sin = rope(shift)
    return apply_rope(q, cos[:, 0].to(q.dtype), sin[:, 0].to(q.dtype))
