"""Speculative decoding in the byte model: tokens a verify step yields, and the bytes per generated token of a
draft + verify round against the plain step. Arithmetic only, no torch (the engine's drafting is
``kvlab.engine.speculative``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlab.roofline.bytes import Prediction, kv_bytes_per_step, predict, predict_tpot_ms, weight_bytes_read
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import same_vocabulary
from kvlab.spec.validation import require_fraction, require_int


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens one speculative verify step yields on average, when each of ``k`` drafts is accepted with probability
    ``acceptance`` given the ones before it were: ``1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)`` (the
    accepted drafts, plus the target's own token after them). ``k + 1`` at ``a = 1``; 1 at ``k = 0``."""
    require_fraction("acceptance", acceptance)
    require_int("k", k, 0)
    return float(k + 1) if acceptance == 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def acceptance_from_rate(rate: float, k: int) -> float:
    """The per-draft ``a`` at which ``k`` drafts per step are kept at ``rate`` = accepted / drafted.

    Serving systems report ``rate``; the byte model needs ``a``. They differ because a step stops judging at its
    first rejection: ``rate = (a + a^2 + ... + a^k) / k``, which equals ``a`` only at ``k = 1``. The rate rises
    with ``a``, so bisection finds the one ``a`` that gives it (to 1e-15; the sum is taken term by term because the
    closed form cancels badly near ``a = 1``).
    """
    require_fraction("rate", rate)
    require_int("k", k, 1)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(1, k + 1)) / k < rate else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SpeculativePrediction:
    """Bytes per generated token with speculative decoding, against plain decoding, from the byte model.

    A round is ``k`` draft steps and one verify step. The verify step runs the target over ``k + 1`` positions of
    each of the ``batch`` sequences: it streams each sequence's KV once (``k`` positions more than a plain step) and
    the weights those ``batch x (k + 1)`` tokens use. For a dense target that is every weight, as in a plain step;
    a mixture of experts routes ``batch x (k + 1)`` tokens, so it reads the experts a plain step of that many tokens
    would (``verify_bytes_per_step``, by ``expected_experts``). Mixtral at batch 1 and ``k = 4`` reads 2.7x a plain
    step's weights to verify, which eats most of what the accepted drafts save.

    - ``target_bytes_per_step``: the plain step the speedup is measured against.
    - ``verify_bytes_per_step``: the verify step (equal to the plain step where no count of it was given).
    - ``draft_bytes_per_step``: one draft step over the same ``batch`` sequences, one token each (0 for prompt
      lookup).

    ``speedup`` is plain bytes per token over speculative bytes per token; it assumes every step is bandwidth-bound,
    which a verify step of ``k + 1`` positions stays at batch 1 but not at large batch (lesson 02's roofline), and it
    leaves out the drafter's fixed per-step costs.
    """

    k: int
    acceptance: float
    tokens_per_step: float
    target_bytes_per_step: int
    draft_bytes_per_step: int
    bytes_per_round: int
    bytes_per_token: float
    speedup: float
    tpot_ms: float
    verify_bytes_per_step: int


def predict_speculative(
    target_bytes_per_step: int,
    k: int,
    acceptance: float,
    bandwidth_gbps: float,
    draft_bytes_per_step: int = 0,
    verify_bytes_per_step: int | None = None,
) -> SpeculativePrediction:
    """``SpeculativePrediction`` for ``k`` drafts per verify step at per-draft acceptance ``acceptance`` (the
    probability ``a`` that a draft is kept given the ones before it were; ``acceptance_from_rate`` converts the
    accepted / drafted share serving systems report). ``verify_bytes_per_step``: what the verify step reads
    (``verify_bytes_per_step(cfg, p, k)``); ``None`` charges it the plain step's bytes, which is right for a dense
    target up to the ``k`` extra positions' KV."""
    require_int("target_bytes_per_step", target_bytes_per_step)
    require_int("draft_bytes_per_step", draft_bytes_per_step, 0)
    verify = target_bytes_per_step if verify_bytes_per_step is None else verify_bytes_per_step
    require_int("verify_bytes_per_step", verify)
    tokens = expected_tokens_per_step(acceptance, k)
    per_round = verify + k * draft_bytes_per_step
    per_token = per_round / tokens
    return SpeculativePrediction(
        k=k,
        acceptance=acceptance,
        tokens_per_step=tokens,
        target_bytes_per_step=target_bytes_per_step,
        draft_bytes_per_step=draft_bytes_per_step,
        bytes_per_round=per_round,
        bytes_per_token=per_token,
        speedup=target_bytes_per_step / per_token,
        tpot_ms=predict_tpot_ms(per_token, bandwidth_gbps),
        verify_bytes_per_step=verify,
    )


def verify_bytes_per_step(cfg: ModelConfig, p: Prediction, k: int) -> int:
    """Bytes a verify step over ``k + 1`` positions of each of ``p.batch`` sequences reads, ``p``'s settings kept.

    Weights: what a step routing ``p.batch x (k + 1)`` tokens reads (``weight_bytes_read``: for a mixture of
    experts, the ``expected_experts`` of that many tokens; for a dense model, the same as a plain step, plus ``k``
    more input-embedding rows per sequence under ``input_embedding="rows"``). KV: each sequence's cache once, at
    ``p.context + k`` tokens (the drafted positions are written and attended to as well). At ``k = 0`` this is
    ``p.bytes_per_step``.
    """
    require_int("k", k, 0)
    weight_dtype = None if p.weight_dtype == "mixed" else p.weight_dtype
    weights = weight_bytes_read(cfg, weight_dtype, p.batch * (k + 1), p.weight_group_size, p.input_embedding)
    kv = kv_bytes_per_step(cfg, p.context + k, p.batch, p.kv_dtype, p.window, p.sinks, p.shared_prefix, p.group_size)
    return weights + kv


def best_speculation_k(
    target_bytes_per_step: int,
    acceptance: float,
    draft_bytes_per_step: int = 0,
    k_max: int = 16,
    verify_bytes: Callable[[int], int] | None = None,
) -> int:
    """The ``k`` in ``0 .. k_max`` with the fewest bytes per token (the smallest such ``k`` on a tie).

    ``verify_bytes``: the verify step's bytes for a given ``k`` (e.g. ``lambda k: verify_bytes_per_step(cfg, p,
    k)``); ``None`` charges every ``k`` the plain step's bytes.
    """
    require_int("k_max", k_max, 0)
    cost = [
        predict_speculative(
            target_bytes_per_step,
            k,
            acceptance,
            1.0,
            draft_bytes_per_step,
            None if verify_bytes is None else verify_bytes(k),
        ).bytes_per_token
        for k in range(k_max + 1)
    ]
    return cost.index(min(cost))


def draft_step(p: Prediction, draft_cfg: ModelConfig) -> Prediction:
    """The draft's own step beside the target's ``p``: the same batch (one token per sequence: a draft step at
    batch B is charged what any step at batch B reads, the experts of B tokens for a mixture of experts), bandwidth
    and input-embedding convention, at the same context clipped to the draft's max context."""
    return predict(
        draft_cfg, min(p.context, draft_cfg.max_seq_len), p.bandwidth_gbps, p.batch, input_embedding=p.input_embedding
    )


def draft_bytes(p: Prediction, draft_cfg: ModelConfig | None, draft_fraction: float | None) -> int:
    """Bytes one draft step reads: ``draft_cfg``'s step, or ``draft_fraction`` of the plain step ``p``, or 0."""
    if draft_cfg is not None:
        return draft_step(p, draft_cfg).bytes_per_step
    return 0 if draft_fraction is None else round(draft_fraction * p.bytes_per_step)


def speculate(
    cfg: ModelConfig,
    p: Prediction,
    k: int,
    acceptance: float,
    draft_cfg: ModelConfig | None = None,
    draft_fraction: float | None = None,
) -> SpeculativePrediction:
    """Speculative decoding over ``cfg``'s plain step ``p``: the verify step reads what ``verify_bytes_per_step``
    counts (a mixture of experts routes ``p.batch x (k + 1)`` tokens), and each of the ``k`` draft steps reads
    ``draft_bytes``. A ``draft_cfg`` whose vocabulary differs from ``cfg``'s is refused (``ValueError``)."""
    if draft_cfg is not None and (why := same_vocabulary(cfg, draft_cfg)):
        raise ValueError(why)
    return predict_speculative(
        p.bytes_per_step,
        k,
        acceptance,
        p.bandwidth_gbps,
        draft_bytes(p, draft_cfg, draft_fraction),
        verify_bytes_per_step(cfg, p, k),
    )
