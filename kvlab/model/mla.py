"""DeepSeek-style multi-head latent attention (MLA): each token caches one latent per layer, shared by all heads.

Shapes: ``B`` batch, ``T`` new tokens, ``S`` tokens attended, ``H`` heads; from ``MLAConfig``: ``r``
(``kv_lora_rank``), ``p`` (``qk_rope_head_dim``), ``n`` (``qk_nope_head_dim``), ``v`` (``v_head_dim``).

A token's cache entry is ``c_kv`` (``r`` wide, RMS-normalised) and one RoPE key ``k_rope`` (``p`` wide, shared by
every head): ``r + p`` elements per layer, where MHA caches ``2 x H x head_dim``. Each head's key and value are
linear in ``c_kv``::

    k_nope[h] = c_kv @ W_uk[h]^T      key[h] = [k_nope[h] | k_rope]      value[h] = c_kv @ W_uv[h]

so attention over the same cache can be computed two ways (``MLAAttention.absorb``):

- naive: up-project every cached latent to per-head keys and values at every step, then standard attention.
- absorbed: ``q_nope[h] . k_nope[h] = (q_nope[h] @ W_uk[h]) . c_kv``, so fold ``W_uk`` into the query (a query in
  latent space) and score against the latent itself; and since the softmax-weighted sum is linear, sum the latents
  and apply ``W_uv`` once, afterwards. A step reads only the latent. Seen this way, MLA is multi-query attention
  with one shared head whose key is ``[c_kv | k_rope]`` (``r + p`` wide) and whose value is ``c_kv``, the key's
  first ``r`` channels: ``kvlab.cache.storage.latent.LatentKVCache`` stores it so, and runs the same kernels as an MQA
cache. This module scales and groups the latent queries (``[B, 1, H, T, r + p]``); the cache only stores and reads.

Absorption is not free: each cached token costs ``2H(2r + p)`` FLOPs instead of ``2H(n + p + v)`` over per-head
K/V, though far less than the naive path's re-expansion (``kvlab.roofline.mla_attention_flops`` counts both paths).

Weights are stored ``[in, out]`` as in ``kvlab.model.decoder``. ``W_uk`` is stored ``[H, n, r]``, the way the absorbed
decode applies it (``q_nope -> latent``); the naive path reads it transposed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kvlab.cache.base import KVCache, SlabKVCache
from kvlab.kernels.reference import causal_attention
from kvlab.model.layers import RMSNorm, RotaryEmbedding, apply_rope
from kvlab.spec.config import ModelConfig


class MLAAttention(nn.Module):
    """MLA for one layer: ``x`` ``[B, T, d_model]`` -> ``[B, T, d_model]``, with a ``LatentKVCache`` or without one.

    ``absorb`` picks the path for cached steps (prefill and decode): ``True`` attends in latent space, ``False``
    re-expands the cached latents to per-head K/V. Without a cache (training, a one-shot forward) the new tokens'
    own K/V are expanded, the form that costs fewest FLOPs when every token is also a query.
    """

    def __init__(self, cfg: ModelConfig, layer: int, absorb: bool = True) -> None:
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"cfg: {cfg.name} has no MLA shape; allowed: a config with mla=MLAConfig(...)")
        m = cfg.mla
        self.layer, self.absorb, self.n_heads = layer, absorb, cfg.n_heads
        self.rank, self.rope_dim, self.nope_dim = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.scale = qk_dim**-0.5  # a head's query and key are n + p wide, in either path
        q_in = m.q_lora_rank or cfg.n_heads * qk_dim
        self._down_split = (q_in, m.kv_lora_rank, m.qk_rope_head_dim)
        # Everything that reads x is one matrix, [in, q (or its latent) | c_kv | k_rope]: one product, not three.
        self.w_down = nn.Parameter(torch.empty(cfg.d_model, sum(self._down_split)))
        if m.q_lora_rank is None:
            self.q_norm, self.wq_up = None, None
        else:
            self.q_norm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
            self.wq_up = nn.Parameter(torch.empty(m.q_lora_rank, cfg.n_heads * qk_dim))
        self.kv_norm = RMSNorm(m.kv_lora_rank, cfg.norm_eps)
        self.w_uk = nn.Parameter(torch.empty(cfg.n_heads, m.qk_nope_head_dim, m.kv_lora_rank))  # [H, n, r]
        self.w_uv = nn.Parameter(torch.empty(cfg.n_heads, m.kv_lora_rank, m.v_head_dim))  # [H, r, v]
        self.wo = nn.Parameter(torch.empty(cfg.n_heads * m.v_head_dim, cfg.d_model))

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        """``cos``, ``sin``: ``[T, 1, p]`` for the new positions (``rope`` is the table they came from: MLA has no
        sliding window, so no cache asks to re-rotate its queries)."""
        b, t, _ = x.shape
        q, c_kv, k_rope = (x @ self.w_down).split(self._down_split, dim=-1)
        if self.wq_up is not None:
            q = self.q_norm(q) @ self.wq_up
        # The softmax scale goes on the query once, before it is split: RoPE and W_uk are linear, so it carries.
        q_nope, q_rope = (q.view(b, t, self.n_heads, -1) * self.scale).split((self.nope_dim, self.rope_dim), dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope[:, :, None], cos, sin)[:, :, 0]  # one RoPE key per token, for every head
        latent = torch.cat((self.kv_norm(c_kv), k_rope), dim=-1)  # [B, T, r + p]
        if cache is None:
            out = self._attend_expanded(q_nope, q_rope, latent, q_start=0)
        else:
            cache.append(self.layer, latent[:, :, None], latent[:, :, None, : self.rank])
            if self.absorb:
                out = self._attend_absorbed(q_nope, q_rope, cache)
            else:
                if not isinstance(cache, SlabKVCache):  # re-expanding assumes slot i holds position i
                    raise ValueError(
                        f"cache: {type(cache).__name__} with absorb=False, which re-expands every cached latent as if "
                        "it held positions 0 .. S-1; allowed: a cache that keeps every latent (LatentKVCache), or "
                        "absorb=True"
                    )
                stored = cache.read(self.layer)[0][:, 0]
                out = self._attend_expanded(q_nope, q_rope, stored, q_start=stored.shape[1] - t)
        return out.reshape(b, t, -1) @ self.wo

    def _attend_expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_start: int
    ) -> torch.Tensor:
        """Standard attention over per-head K/V made from ``latent`` ``[B, S, r + p]``.

        ``q_nope``: ``[B, T, H, n]``, ``q_rope``: ``[B, T, H, p]``, scaled, at positions ``q_start ..``;
        -> ``[B, T, H, v]``.
        """
        c_kv, k_rope = latent[:, None].split((self.rank, self.rope_dim), dim=-1)  # broadcast over heads
        k_nope = c_kv @ self.w_uk.transpose(1, 2)  # [B, H, S, n]
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)[:, :, None]  # H KV heads of one query each
        return causal_attention(q, k, c_kv @ self.w_uv, q_start)[:, :, 0].transpose(1, 2)

    def _attend_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Attention in latent space, reading only the cached latents; shapes as ``_attend_expanded``."""
        q_latent = q_nope.transpose(1, 2) @ self.w_uk  # [B, H, T, r]
        # One KV head (the latent) shared by all H query heads: grouped, the queries are [B, 1, H, T, r + p].
        grouped = torch.cat((q_latent, q_rope.transpose(1, 2)), dim=-1)[:, None]
        out_latent = cache.attend(self.layer, grouped)[:, 0]  # [B, H, T, r]
        return (out_latent @ self.w_uv).transpose(1, 2)
