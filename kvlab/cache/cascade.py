"""Shared-prefix ("cascade") decode attention: read a prefix the whole batch shares once per step, not once per
sequence.

Softmax attention over the keys ``prefix + suffix`` equals attention over each part on its own, with the two
outputs weighted by their share of the total softmax mass, ``exp(lse_part - lse_total)``. So when B sequences
share their first P tokens (the same blocks in a paged cache), one matmul of all ``B x G`` queries of a KV head
against the prefix reads its K/V once; each sequence then attends over its own suffix, and the two partial
results are merged with their log-sum-exp. FlashInfer's cascade attention and Hydragen do the same on GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def partial_attention(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one part of the keys, with what a merge needs.

    ``q``: ``[..., M, D]`` (scaled by ``1/sqrt(D)``); ``k_t``: ``[..., D, S]`` (key-major); ``v``: ``[..., S, D]``.
    Returns ``out``: ``[..., M, D]`` and ``lse``: ``[..., M, 1]``, the log-sum-exp of the scores (``-inf`` when
    ``S == 0``, so an empty part gets no weight in the merge).
    """
    scores = torch.matmul(q, k_t)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each set's ``(out, lse)`` (shapes as above)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse)


def cascade_decode_attention(
    q: torch.Tensor,
    prefix_k_t: torch.Tensor,
    prefix_v: torch.Tensor,
    suffix_k_t: torch.Tensor,
    suffix_v: torch.Tensor,
) -> torch.Tensor:
    """Decode attention for B sequences whose first P tokens are the same K/V.

    ``q``: ``[B, Hkv, G, D]``, the G query heads of each KV head, scaled by ``1/sqrt(D)``.
    ``prefix_k_t``: ``[Hkv, D, P]`` and ``prefix_v``: ``[Hkv, P, D]``, shared by the batch (read once).
    ``suffix_k_t``: ``[B, Hkv, D, S]`` and ``suffix_v``: ``[B, Hkv, S, D]``, each sequence's own tokens.
    Returns ``[B, Hkv, G, D]``, equal (to rounding) to ``kvlab.kernels.decode_attention`` over prefix + suffix.
    """
    b, hkv, g, d = q.shape
    expected = {
        "prefix_k_t": (hkv, d, prefix_k_t.shape[-1]),
        "prefix_v": (hkv, prefix_k_t.shape[-1], d),
        "suffix_k_t": (b, hkv, d, suffix_k_t.shape[-1]),
        "suffix_v": (b, hkv, suffix_k_t.shape[-1], d),
    }
    given = {"prefix_k_t": prefix_k_t, "prefix_v": prefix_v, "suffix_k_t": suffix_k_t, "suffix_v": suffix_v}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ValueError(
                f"{name}: shape {tuple(given[name].shape)}; allowed: {shape} for q of shape {(b, hkv, g, d)}"
            )
    # Every query that reads this KV head's prefix, in one matrix: [Hkv, B*G, D] @ [Hkv, D, P].
    stacked = q.transpose(0, 1).reshape(hkv, b * g, d)
    out_p, lse_p = partial_attention(stacked, prefix_k_t, prefix_v)
    out_p = out_p.view(hkv, b, g, d).transpose(0, 1)
    lse_p = lse_p.view(hkv, b, g, 1).transpose(0, 1)
    out_s, lse_s = partial_attention(q, suffix_k_t, suffix_v)
    return merge_partials(out_p, lse_p, out_s, lse_s)


def shared_prefix_blocks(tables: Sequence[Sequence[int]]) -> int:
    """How many leading entries all block tables have in common (the blocks a cascade step reads once)."""
    if not tables:
        return 0
    n = min(len(t) for t in tables)
    first = tables[0]
    for i in range(n):
        if any(t[i] != first[i] for t in tables):
            return i
    return n
