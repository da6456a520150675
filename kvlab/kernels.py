"""Attention kernels in plain PyTorch, written for the shapes a KV cache hands them.

Decode (one query per sequence) is a matrix-vector product over the whole cache, so its speed is set by how
the cache's bytes are laid out. Keys stored key-major (``[D, S]`` per head) let ``q @ K`` stream each row of D
contiguous runs of S values; token-major keys (``[S, D]``) made the same product run at half the bandwidth on
a 2-core AMD EPYC (docs/cpu_performance.md, which also shows ``p @ V`` as the slower of the two products).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Grouped attention of one query per head over S cached tokens.

    ``q``: ``[B, Hkv, G, D]``, the G query heads that share each KV head, already scaled by ``1/sqrt(D)``.
    ``k_t``: ``[B, Hkv, D, S]`` (key-major). ``v``: ``[B, Hkv, S, D]``. Returns ``[B, Hkv, G, D]``.

    One batched matmul per KV head group reads each K/V byte once for all G query heads; SDPA's
    ``enable_gqa`` on CPU re-reads K/V once per query head instead.
    """
    scores = torch.matmul(q, k_t)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


MAX_SCORES = 2**26  # attention scores one prefill block may hold: 256 MB in fp32


def window_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None = None, sinks: int = 0
) -> torch.Tensor:
    """Which keys each query may see: ``[T]``, ``[n]`` -> bool ``[T, n]``, True where visible.

    Causal, and with a ``window``, only the ``window`` most recent keys (the query's own included) plus the first
    ``sinks`` positions. ``window=None`` is plain causal attention.
    """
    q, k = q_positions[:, None], k_positions[None, :]
    visible = k <= q
    if window is not None:
        visible &= (k > q - window) | (k < sinks)
    return visible


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None = None
) -> torch.Tensor:
    """Causal attention for several new queries (prefill, or a multi-token step).

    ``q``: ``[B, H, T, D]`` at positions ``q_start .. q_start+T-1``; ``k``, ``v``: ``[B, Hkv, S, D]`` at positions
    ``0 .. S-1``. Query t sees keys ``0 .. q_start+t`` (only the last ``window`` of them for a sliding-window
    layer). Returns ``[B, H, T, D]``.
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    block = max(1, MAX_SCORES // (q.shape[0] * q.shape[1] * n_k))
    if block < n_q:
        # A long prefill would materialise T x T scores per head (34 GB at 32k tokens, 8 heads): take the queries
        # a block at a time, each against only the keys it can see.
        return torch.cat(
            [
                causal_attention(
                    q[..., i : i + block, :],
                    k[..., : q_start + i + block, :],
                    v[..., : q_start + i + block, :],
                    q_start + i,
                    window,
                )
                for i in range(0, n_q, block)
            ],
            dim=-2,
        )
    if window is None and q_start == 0 and n_q == n_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    positions = torch.arange(max(n_k, q_start + n_q), device=q.device)
    mask = window_mask(positions[q_start : q_start + n_q], positions[:n_k], window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
