"""Choosing the next token from logits: greedy, or temperature with top-k / top-p truncation."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``logits``: ``[B, V]`` -> token ids ``[B]``. ``temperature == 0`` is greedy (argmax)."""
    if temperature < 0:
        raise ValueError(f"temperature: {temperature}; allowed: a number >= 0 (0 is greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k: {top_k}; allowed: an integer >= 1, or None")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: {top_p}; allowed: a number in (0, 1], or None")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the ones ranked above it already reach top_p; the most likely token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
