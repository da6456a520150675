"""Choosing the next token from logits: greedy, or temperature with top-k / top-p truncation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.spec.validation import require_int, require_number


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


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability under the model (before temperature and truncation), and the ``top``
    most likely tokens' ``(id, logprob)``, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How one engine request picks its tokens.

    ``temperature`` 0 is greedy (``top_k``, ``top_p`` and ``seed`` then change nothing); above 0 each token is drawn
    from ``softmax(logits / temperature)`` cut by ``top_k`` and ``top_p`` (``sample_next``), with a generator seeded
    by ``seed`` (None: a fresh random seed), so a seeded request draws the same tokens whatever else is batched with
    it. A token in ``stop_token_ids`` ends the request (it is still an output token). ``logprobs``: None, or how
    many alternatives to report beside each chosen token's log-probability (0: the chosen one only).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        require_number("temperature", self.temperature, 0, note="0 is greedy")
        require_int("top_k", self.top_k, 1, or_none=True)
        require_number("top_p", self.top_p, 0, 1, low_open=True, or_none=True)
        require_int("logprobs", self.logprobs, 0, or_none=True)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream (None when greedy)."""
        if self.temperature == 0:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed % 2**64)  # any integer a client sends maps to a valid seed
        return gen


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, argmax: int
) -> tuple[int, TokenLogprobs | None]:
    """One request's next token from its ``logits`` ``[V]`` (``argmax``: their argmax, already computed for the
    batch), and its log-probabilities if ``params.logprobs`` asks for them."""
    token = (
        argmax
        if params.temperature == 0
        else int(sample_next(logits[None], params.temperature, params.top_k, params.top_p, generator)[0])
    )
    if params.logprobs is None:
        return token, None
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, min(params.logprobs, logp.shape[-1])) if params.logprobs else None
    pairs = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return token, TokenLogprobs(token, float(logp[token]), pairs)
