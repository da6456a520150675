"""Attention over integer-coded K/V without dequantizing them: scores as int8 dot products, values with their
scales folded into the probabilities. The codes, scales and biases are plain tensors: which codec produced them
is the cache's business (``kvlab.cache.codec``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def int8_key_scores(
    qs: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``q . k`` for int8 keys grouped per token, computed as integer dot products on the stored codes.

    ``qs``: ``[B, Hkv, g, D]`` fp32; ``codes``: ``[B, Hkv, S, D]`` int8, grouped on the channel dim (dim 3) in
    ``nJ`` groups of ``group_size``; ``scale``, ``bias``: ``[B, Hkv, S, nJ]``. Returns ``[B, Hkv, g, S]``.
    With ``k ~= scale * code + bias`` per (token, channel group) and q quantized per row as ``q ~= sigma * qi``,
    channel group j contributes ``sigma * scale_j * (qi_j . code_j) + bias_j * sum(q_j)``: one int8 matmul per
    head, then fp32 work over ``[nJ, g, S]`` only, ``D / (g * nJ)`` times less than the keys.
    """
    b, h, g, d = qs.shape
    n_tokens, n_groups = codes.shape[2], math.ceil(d / group_size)
    sigma = qs.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    qi = torch.round(qs / sigma).to(torch.int8)
    # Row (j, r) of the left operand keeps query r's channels of group j and zeros elsewhere, so one matmul per
    # head returns every group's partial dot products while reading the codes once. Built fresh, so each
    # [rows, D] slice has ordinary strides: torch 2.13's CPU _int_mm returns wrong sums for a [1, D] operand
    # with strides (1, 1), the kind a transposed column has.
    blocks = (qi.unsqueeze(2) * _group_mask(d, group_size, qs.device)[:, None, :]).reshape(b, h, -1, d)
    dots = torch.empty(b, h, n_groups * g, n_tokens, dtype=torch.int32, device=qs.device)
    for bi in range(b):
        for hd in range(h):
            # Codes as a transposed view on the right ran several times faster on CPU than codes @ q.T.
            torch._int_mm(blocks[bi, hd], codes[bi, hd].T, out=dots[bi, hd])
    per_group = scale.float().transpose(-1, -2).unsqueeze(-2)  # [B, Hkv, nJ, 1, S]
    weighted = (dots.view(b, h, n_groups, g, n_tokens).float() * per_group).sum(dim=2)
    q_sums = torch.matmul(qs, _group_mask(d, group_size, qs.device).T.float())  # [B, Hkv, g, nJ]
    scores = torch.matmul(q_sums, bias.transpose(-1, -2))  # the bias terms, [B, Hkv, g, S]
    return scores.addcmul_(weighted, sigma)


def folded_value_product(
    p: torch.Tensor,
    codes: Callable[[int, int], torch.Tensor],
    scale: torch.Tensor,
    bias: torch.Tensor,
    group_size: int,
    buf: torch.Tensor,
) -> torch.Tensor:
    """``p @ v`` for integer values ``v ~= scale * code + bias``, grouped per token, with the scales folded into ``p``.

    ``p``: ``[B, Hkv, M, n]``; ``codes(start, c)``: the values' integer codes of tokens ``start .. start + c``,
    ``[B, Hkv, c, D]`` (any integer dtype: a packed codec unpacks one chunk at a time), grouped on the channel dim in
    ``nJ`` groups of ``group_size``; ``scale``, ``bias``: ``[B, Hkv, n, nJ]``; ``buf``: fp32 scratch
    ``[B, Hkv, c, D]``, whose length ``c`` sets the chunk. Returns ``[B, Hkv, M, D]``.
    Since ``v ~= scale * code + bias`` per (token, channel group), channel group j of the result is
    ``(p * scale_j) @ code_j + p @ bias_j``. The codes are converted to fp32 a chunk at a time and never scaled
    (dequantizing would cost two more passes over each chunk); each chunk takes one matmul for all groups.
    """
    b, h, m, n = p.shape
    size, d, chunk = group_size, buf.shape[-1], buf.shape[2]
    n_groups = math.ceil(d / size)
    # [B*Hkv, nJ*M, n]: p scaled by each channel group's per-token scale; rows of group j are only kept for
    # group j's channels at the end, so one matmul per chunk serves every group.
    weights = (p.unsqueeze(2) * scale.float().transpose(-1, -2).unsqueeze(3)).reshape(b * h, n_groups * m, n)
    acc = torch.zeros(b * h, n_groups * m, d, device=p.device)
    for start in range(0, n, chunk):
        c = min(chunk, n - start)
        chunk_codes = buf[:, :, :c].copy_(codes(start, c))
        acc.baddbmm_(weights[..., start : start + c], chunk_codes.view(b * h, c, d))
    acc = acc.view(b, h, n_groups, m, d)
    out = torch.cat([acc[:, :, j, :, lo : lo + size] for j, lo in enumerate(range(0, d, size))], dim=-1)
    return out.add_(torch.matmul(p, bias).repeat_interleave(size, dim=-1)[..., :d])


def _group_mask(d: int, size: int, device: torch.device) -> torch.Tensor:
    """``[nJ, D]`` bool: channel c belongs to group ``c // size``."""
    channels = torch.arange(d, device=device)
    return channels[None, :] // size == torch.arange(math.ceil(d / size), device=device)[:, None]
