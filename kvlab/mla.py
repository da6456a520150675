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
  first ``r`` channels: ``LatentKVCache`` stores it so, and runs the same kernels as an MQA cache.

Absorption is not free: each cached token costs ``2H(2r + p)`` FLOPs instead of ``2H(n + p + v)`` over per-head
K/V, though far less than the naive path's re-expansion (``decode_flops`` counts both paths).

Weights are stored ``[in, out]`` as in ``kvlab.model``. ``W_uk`` is stored ``[H, n, r]``, the way the absorbed
decode applies it (``q_nope -> latent``); the naive path reads it transposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from kvlab.cache.base import KVCache
from kvlab.config import MLAConfig, ModelConfig
from kvlab.dtypes import canonical_dtype, torch_dtype
from kvlab.kernels import causal_attention, decode_attention
from kvlab.model import Decoder, RMSNorm, apply_rope
from kvlab.validation import require_int


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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentKVCache | None
    ) -> torch.Tensor:
        """``cos``, ``sin``: ``[T, 1, p]`` for the new positions."""
        b, t, _ = x.shape
        q, c_kv, k_rope = (x @ self.w_down).split(self._down_split, dim=-1)
        if self.wq_up is not None:
            q = self.q_norm(q) @ self.wq_up
        q_nope, q_rope = q.view(b, t, self.n_heads, -1).split((self.nope_dim, self.rope_dim), dim=-1)
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
                stored = cache.read(self.layer)[0][:, 0]
                out = self._attend_expanded(q_nope, q_rope, stored, q_start=stored.shape[1] - t)
        return out.reshape(b, t, -1) @ self.wo

    def _attend_expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_start: int
    ) -> torch.Tensor:
        """Standard attention over per-head K/V made from ``latent`` ``[B, S, r + p]``.

        ``q_nope``: ``[B, T, H, n]``, ``q_rope``: ``[B, T, H, p]`` at positions ``q_start ..``; -> ``[B, T, H, v]``.
        """
        c_kv, k_rope = latent[:, None].split((self.rank, self.rope_dim), dim=-1)  # broadcast over heads
        k_nope = c_kv @ self.w_uk.transpose(1, 2)  # [B, H, S, n]
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)
        # SDPA's default scale, 1/sqrt(n + p), is MLA's.
        return causal_attention(q, k, c_kv @ self.w_uv, q_start).transpose(1, 2)

    def _attend_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: LatentKVCache) -> torch.Tensor:
        """Attention in latent space, reading only the cached latents; shapes as ``_attend_expanded``."""
        q_latent = (q_nope.transpose(1, 2) @ self.w_uk).transpose(1, 2)  # [B, T, H, r]
        out_latent = cache.attend(self.layer, torch.cat((q_latent, q_rope), dim=-1))  # [B, T, H, r]
        return (out_latent.transpose(1, 2) @ self.w_uv).transpose(1, 2)


class LatentKVCache(KVCache):
    """MLA's cache: per layer and token, the latent ``[c_kv | k_rope]``, ``r + p`` elements, nothing per head.

    The ``KVCache`` calls keep their meaning in the multi-query view of MLA (one KV head, ``head_dim = r + p``):

    - ``append(layer, k, v)``: ``k`` ``[B, T, 1, r + p]`` is ``[c_kv | k_rope]`` (RoPE applied); ``v`` must be
      ``k[..., :r]``, the same bytes, which are stored once.
    - ``attend(layer, q)``: ``q`` ``[B, T, H, r + p]``, queries already folded into latent space (RoPE applied on
      the last ``p``) -> ``[B, T, H, r]``, each head's softmax-weighted sum of latents (``W_uv`` not yet applied).
    - ``read(layer)``: ``K`` ``[B, 1, S, r + p]`` and ``V`` ``[B, 1, S, r]``, views of the same storage.

    Byte methods count each latent element once, as ``kvlab.roofline.kv_bytes_per_token`` does for MLA. A fused
    kernel reads them once per step; this unfused one streams ``c_kv`` twice (scores, then the weighted sum).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        capacity: int,
        mla: MLAConfig,
        dtype: str | torch.dtype = "fp32",
        device: str | torch.device = "cpu",
    ) -> None:
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("capacity", capacity)):
            require_int(name, value)
        self.n_layers, self.batch_size, self.capacity = n_layers, batch_size, capacity
        self.n_kv_heads, self.head_dim = 1, mla.cached_elements_per_layer
        self.kv_lora_rank = mla.kv_lora_rank
        self.softmax_scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        self.dtype_name = canonical_dtype(dtype, "kv dtype", allowed=("fp32", "fp16", "bf16"))
        # Token-major: the one slab is both K and V, so it cannot be key-major for the scores and token-major for
        # the weighted sum at once. Every head scores against the same latent, so q.K is a matrix product here,
        # not the matrix-vector product that key-major storage sped up for MHA.
        shape = (n_layers, batch_size, capacity, self.head_dim)
        self._latent = torch.zeros(shape, dtype=torch_dtype(self.dtype_name), device=device)
        self._layers = list(self._latent.unbind(0))  # views made once, not indexed per layer per step
        self._length = 0
        self._start = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def element_bytes(self) -> float:
        return self._latent.element_size()

    @property
    def device(self) -> torch.device:
        return self._latent.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return self._latent.dtype

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes one token of one sequence takes across all layers: one latent per layer, no separate V."""
        return self.n_layers * self.head_dim * self.element_bytes

    def reserve(self, n_new: int) -> int:
        return self._claim_slots(n_new)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if v.data_ptr() != k.data_ptr() or v.shape != k[..., : self.kv_lora_rank].shape:
            raise ValueError("v: must be k[..., :kv_lora_rank]; MLA's value is the latent itself, stored once")
        self._layers[layer][:, self._start : self._length] = k[:, :, 0]

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        k, v = self.read(layer)
        if q.shape[1] == 1:
            # With one KV head, q's [B, 1, H, r + p] is already decode_attention's [B, Hkv, G, D].
            return decode_attention(q * self.softmax_scale, k.transpose(-1, -2), v)
        # causal_attention divides by sqrt(r + p), SDPA's default; MLA's scale is 1/sqrt(n + p).
        q = q.transpose(1, 2) * (self.softmax_scale * q.shape[-1] ** 0.5)
        return causal_attention(q, k, v, q_start=self._start).transpose(1, 2)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._layers[layer][:, None, : self._length]
        return k, k[..., : self.kv_lora_rank]

    def reset(self) -> None:
        self._length = 0
        self._start = 0

    def fast_fill(self, n_tokens: int, generator: torch.Generator | None = None, chunk: int = 2048) -> None:
        """``KVCache.fast_fill`` for latents: standard-normal ``[c_kv | k_rope]`` rows, all layers at once."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens: {n_tokens}; allowed: an integer >= 0")
        for done in range(0, n_tokens, chunk):
            n = min(chunk, n_tokens - done)
            start = self.reserve(n)
            rows = torch.randn((self.n_layers, self.batch_size, n, self.head_dim), generator=generator)
            self._latent[:, :, start : start + n] = rows.to(self.device, self.torch_dtype)


def set_absorb(model: Decoder, absorb: bool) -> Decoder:
    """Switch every MLA layer of ``model`` to the absorbed (``True``) or the naive (``False``) path; returns it."""
    if model.cfg.mla is None:
        raise ValueError(f"model: {model.cfg.name} has no MLA layers; allowed: a Decoder built with mla=MLAConfig")
    for block in model.layers:
        block.attn.absorb = absorb
    return model


@dataclass(frozen=True)
class DecodeFlops:
    """FLOPs (2 per multiply-add) of one layer's attention for one new token over ``context`` tokens, by part.

    Elementwise work (softmax, RoPE, norms) is left out: it is small beside these products.
    """

    context: int
    projections: int  # both paths: x -> query and latent (q up-projection too with q_lora_rank), and the output
    expand: int  # naive: up-project every cached latent to per-head K and V, 2 S r H (n + v)
    attend_expanded: int  # naive: q.K and p.V over per-head K/V, 2 S H (n + p + v)
    absorb: int  # absorbed: fold W_uk into the query and apply W_uv to the result, 2 H r (n + v), once per token
    attend_latent: int  # absorbed: scores against [c_kv | k_rope] and the weighted sum of c_kv, 2 S H (2 r + p)

    @property
    def naive(self) -> int:
        return self.projections + self.expand + self.attend_expanded

    @property
    def absorbed(self) -> int:
        return self.projections + self.absorb + self.attend_latent

    @property
    def absorption_extra(self) -> int:
        """What absorption costs beyond attention over per-head K/V, as MHA with a full cache would compute it."""
        return self.absorb + self.attend_latent - self.attend_expanded


def decode_flops(cfg: ModelConfig, context: int) -> DecodeFlops:
    """FLOPs of one decode token's attention in one MLA layer, attending over ``context`` tokens, both paths.

    For DeepSeek-V3 (H 128, r 512, p 64, n 128, v 128) each attended token costs 278,528 FLOPs absorbed against
    81,920 over per-head K/V (3.4x), in exchange for reading 576 cached elements instead of 40,960; the naive path
    spends 33,554,432 FLOPs per token re-expanding it (at 4,096 tokens: 138.1 GFLOP per layer naive, 1.52 absorbed).
    In bf16, absorbed attention does about 242 FLOPs per cached byte it reads (MHA: 1), above an H200's datasheet
    ratio of dense FLOP/s to bandwidth (989e12 / 4.8e12 = 206): on paper that part of the step is bound by compute,
    not by the bytes it reads.
    """
    m = cfg.mla
    if m is None:
        raise ValueError(f"cfg: {cfg.name} has no MLA shape; allowed: a config with mla=MLAConfig(...)")
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise ValueError(f"context: {context!r}; allowed: an integer >= 1 (the new token attends to itself)")
    h, r, p, n, v = cfg.n_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    q_in = m.q_lora_rank or h * (n + p)
    projections = 2 * cfg.d_model * (q_in + r + p) + 2 * h * v * cfg.d_model
    if m.q_lora_rank is not None:
        projections += 2 * m.q_lora_rank * h * (n + p)
    return DecodeFlops(
        context=context,
        projections=projections,
        expand=2 * context * r * h * (n + v),
        attend_expanded=2 * context * h * (n + p + v),
        absorb=2 * h * r * (n + v),
        attend_latent=2 * context * h * (2 * r + p),
    )
