"""Every float attention kernel in kvlab, in plain PyTorch, written for the shapes a KV cache hands them.

Queries arrive *grouped and scaled*: ``[B, Hkv, G, T, D]`` (or ``[B, Hkv, G, D]`` for one decode token), the G
query heads that share each KV head, already multiplied by the softmax scale. The attention module owns the
scale and the grouping (``kvlab.model.attention``); a kernel only reads keys and values.

Decode (one query per sequence) is a matrix-vector product over the whole cache, so its speed is set by how the
cache's bytes are laid out. Keys stored key-major (``[D, S]`` per head) let ``q @ K`` stream each row of D
contiguous runs of S values; token-major keys (``[S, D]``) made the same product run at half the bandwidth on a
2-core AMD EPYC (docs/cpu_performance.md, which also shows ``p @ V`` as the slower of the two products).

Attention over a union of disjoint key sets is the merge of each set's ``(out, lse)``: cascade attention merges a
shared prefix with each sequence's suffix, and online softmax is a fold of the same merge over chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvlab.spec.keep import SinksAndWindow

MAX_SCORES = 2**26  # attention scores one prefill block may hold: 256 MB in fp32
_FLOOR = torch.finfo(torch.float32).min  # stands in for an lse of -inf, so an empty part weighs exp(-inf) = 0


def decode_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Grouped attention of one query per head over S cached tokens.

    ``q``: ``[B, Hkv, G, D]``, scaled. ``k_t``: ``[B, Hkv, D, S]`` (key-major). ``v``: ``[B, Hkv, S, Dv]``.
    Returns ``[B, Hkv, G, Dv]``. One batched matmul per KV head group reads each K/V byte once for all G query
    heads; SDPA's ``enable_gqa`` on CPU re-reads K/V once per query head instead.
    """
    scores = torch.matmul(q, k_t)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def window_mask(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None = None,
    sinks: int = 0,
    layer_window: int | None = None,
) -> torch.Tensor:
    """Which keys each query may see: ``[T]``, ``[..., n]`` -> bool ``[..., T, n]``, True where visible.

    ``kvlab.spec.keep.SinksAndWindow(window, sinks)``'s rule, within ``layer_window``: causal, and with a
    ``window``, only the ``window`` most recent keys (the query's own included) plus the first ``sinks`` positions.
    ``window=None`` is plain causal attention.
    """
    return SinksAndWindow(window, sinks).visible(q_positions[:, None], k_positions[..., None, :], layer_window)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None = None
) -> torch.Tensor:
    """Causal attention for several new queries (prefill, or a multi-token step).

    ``q``: ``[B, Hkv, G, T, D]``, scaled, at positions ``q_start .. q_start+T-1``; ``k``: ``[B, Hkv, S, D]`` and
    ``v``: ``[B, Hkv, S, Dv]`` at positions ``0 .. S-1``. Query t sees keys ``0 .. q_start+t`` (only the last
    ``window`` of them for a sliding-window layer). Returns ``[B, Hkv, G, T, Dv]``.
    """
    b, hkv, g, n_q, d = q.shape
    n_k = k.shape[-2]
    block = max(1, MAX_SCORES // (b * hkv * g * n_k))
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
    heads = q.reshape(b, hkv * g, n_q, d)  # SDPA's GQA maps query head h to KV head h // G, as the grouping does
    if window is None and q_start == 0 and n_q == n_k:
        out = F.scaled_dot_product_attention(heads, k, v, is_causal=True, enable_gqa=True, scale=1.0)
    else:
        positions = torch.arange(max(n_k, q_start + n_q), device=q.device)
        mask = window_mask(positions[q_start : q_start + n_q], positions[:n_k], window)
        out = F.scaled_dot_product_attention(heads, k, v, attn_mask=mask, enable_gqa=True, scale=1.0)
    return out.view(b, hkv, g, n_q, -1)


def attend_slab(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None = None
) -> torch.Tensor:
    """This step's queries over a slab holding positions ``0 .. S-1``, the new ones last: a cache's ``attend``.

    ``q``: ``[B, Hkv, G, T, D]``, scaled; ``k_t``: ``[B, Hkv, D, S]``; ``v``: ``[B, Hkv, S, Dv]``. A decode step
    with a ``window`` reads only the last ``window`` tokens, and reads the slots in any order (one query sees them
    all). Returns ``[B, Hkv, G, T, Dv]``.
    """
    if q.shape[-2] > 1:
        if k_t.shape[-1] != q_start + q.shape[-2]:
            # The slab must end with this step's tokens: a cache whose append stored nothing, or stored them along
            # the wrong axis, would otherwise fail deep inside a matmul or attend over the wrong tokens.
            raise ValueError(
                f"k_t: {k_t.shape[-1]} tokens along its last axis, but this step's queries sit at positions "
                f"{q_start}..{q_start + q.shape[-2] - 1}; allowed: keys [B, Hkv, D, S] holding positions "
                f"0..{q_start + q.shape[-2] - 1} (does append store the new tokens after the old ones, along S?)"
            )
        return causal_attention(q, k_t.transpose(-1, -2), v, q_start, window)
    if window is not None and k_t.shape[-1] > window:
        k_t, v = k_t[..., -window:], v[..., -window:, :]
    return decode_attention(q[..., 0, :], k_t, v).unsqueeze(-2)


def attention_with_probs(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    sink_q: torch.Tensor | None = None,
    n_sinks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped attention that also returns its probabilities (what H2O accumulates), for keys in any order.

    ``q``: ``[B, Hkv, G, T, D]``, scaled. ``k_t``: ``[B, Hkv, D, n]`` (key-major). ``v``: ``[B, Hkv, n, Dv]``.
    ``mask``: bool, broadcastable to ``[B, Hkv, 1, T, n]`` (e.g. ``[T, n]``), True where visible. ``sink_q``,
    shaped like ``q``, replaces ``q`` for the first ``n_sinks`` keys (the re-assigned-positions window scores
    sinks with a rotated query). Returns ``out``: ``[B, Hkv, G, T, Dv]`` and ``probs``: ``[B, Hkv, G, T, n]``.
    """
    b, hkv, g, t, d = q.shape
    scores = torch.matmul(q.reshape(b, hkv, g * t, d), k_t)
    if sink_q is not None:
        scores[..., :n_sinks] = torch.matmul(sink_q.reshape(b, hkv, g * t, d), k_t[..., :n_sinks])
    scores = scores.view(b, hkv, g, t, -1)
    if mask is not None:
        if mask.dim() == 4:  # per sequence and KV head: [B, Hkv, T, n], the same for the G heads of a group
            mask = mask[:, :, None]
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(b, hkv, g * t, -1), v).view(b, hkv, g, t, -1)
    return out, probs


def partial_attention(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one part of the keys, with what a merge needs.

    ``q``: ``[..., M, D]`` (scaled); ``k_t``: ``[..., D, S]`` (key-major); ``v``: ``[..., S, Dv]``; ``mask``: bool
    ``[M, S]``, True where visible. Returns ``out``: ``[..., M, Dv]`` and ``lse``: ``[..., M, 1]``, the log-sum-exp
    of the visible scores (``-inf`` where a row sees none, which the merge then weighs by zero).
    """
    scores = torch.matmul(q, k_t)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse.clamp_min(_FLOOR)), v), lse


def merge_partials(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` over the union of two disjoint key sets, from each set's ``(out, lse)`` (shapes as above)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    floor = lse.clamp_min(_FLOOR)
    return out_a * torch.exp(lse_a - floor) + out_b * torch.exp(lse_b - floor), lse


def online_softmax_attention(
    q: torch.Tensor, chunks: Iterable[tuple[torch.Tensor, torch.Tensor, int]], q_pos: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention over keys and values that arrive a chunk at a time (FlashAttention's running softmax).

    ``q``: ``[B, Hkv, M, D]``, scaled; ``chunks``: ``(k, v, start)`` with ``k``: ``[B, Hkv, n, D]`` (token-major)
    and ``v``: ``[B, Hkv, n, Dv]`` at positions ``start .. start+n-1``. With ``q_pos`` (``[M]``, each row's
    position) a row sees only keys at or before it; without, every key. Returns ``[B, Hkv, M, Dv]``. Each chunk
    is one ``partial_attention``, and the running result is their fold by ``merge_partials``.
    """

    def part(chunk: tuple[torch.Tensor, torch.Tensor, int]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, start = chunk
        mask = None
        if q_pos is not None and start + k.shape[-2] - 1 > int(q_pos.min()):
            mask = torch.arange(start, start + k.shape[-2], device=q.device)[None, :] <= q_pos[:, None]
        return partial_attention(q, k.transpose(-1, -2), v, mask)

    return functools.reduce(merge_partials, map(part, chunks))[0]


def cascade_decode_attention(
    q: torch.Tensor,
    prefix_k_t: torch.Tensor,
    prefix_v: torch.Tensor,
    suffix_k_t: torch.Tensor,
    suffix_v: torch.Tensor,
) -> torch.Tensor:
    """Decode attention for B sequences whose first P tokens are the same K/V, reading that prefix once.

    ``q``: ``[B, Hkv, G, D]``, scaled. ``prefix_k_t``: ``[Hkv, D, P]`` and ``prefix_v``: ``[Hkv, P, D]``, shared
    by the batch. ``suffix_k_t``: ``[B, Hkv, D, S]`` and ``suffix_v``: ``[B, Hkv, S, D]``, each sequence's own.
    Returns ``[B, Hkv, G, D]``, equal (to rounding) to ``decode_attention`` over prefix + suffix: one matmul of all
    ``B x G`` queries of a KV head against the prefix, one per sequence against its suffix, merged by their lse
    (FlashInfer's cascade attention and Hydragen do the same on GPU).
    """
    b, hkv, g, d = q.shape
    p, s = prefix_k_t.shape[-1], suffix_k_t.shape[-1]
    expected = {
        "prefix_k_t": ((hkv, d, p), prefix_k_t),
        "prefix_v": ((hkv, p, d), prefix_v),
        "suffix_k_t": ((b, hkv, d, s), suffix_k_t),
        "suffix_v": ((b, hkv, s, d), suffix_v),
    }
    for name, (shape, given) in expected.items():
        if tuple(given.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(given.shape)}; allowed: {shape} for q of shape {(b, hkv, g, d)}")
    stacked = q.transpose(0, 1).reshape(hkv, b * g, d)  # every query that reads this KV head's prefix
    out_p, lse_p = partial_attention(stacked, prefix_k_t, prefix_v)
    prefix = out_p.view(hkv, b, g, d).transpose(0, 1), lse_p.view(hkv, b, g, 1).transpose(0, 1)
    return merge_partials(prefix, partial_attention(q, suffix_k_t, suffix_v))[0]
