"""Lesson 11, the capstone incident: the KV pool a GPU holds beside the weights, the two terms of a decode step's
bytes over a ragged batch, the term that grew between two moments of the incident, and the fix, judged by replaying
it (the SLOs at scale, the quality floor on the checkpoint), never by numbers the learner types."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvlab.course.grading import call_learner, close_to, config_label, exact_int, fail, is_real
from kvlab.course.incident import INCIDENT, PUBLIC_SEEDS, Fix, Incident, pool_tokens
from kvlab.model.decoder import Decoder
from kvlab.roofline import kv_bytes_per_step, kv_bytes_per_token, weight_bytes_read
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import get_gpu, get_model

__all__ = ["check_fix", "check_grown_term", "check_pool_tokens", "check_step_terms"]

TERMS = ("weights", "kv")


def _model(model: str | ModelConfig) -> ModelConfig:
    return get_model(model) if isinstance(model, str) else model


# -- exercise 1: the pool -------------------------------------------------------------------------------------------
_POOL_CASES = (
    ("llama-3.1-8b", "h100-sxm", None, 0.9),
    ("llama-3.1-8b", "h100-sxm", "fp8", 0.9),
    ("qwen3-8b", "l40s", "int4", 0.85),  # int4 with its fp16 scales: a fractional byte count per token
)


def check_pool_tokens(fn: Callable, cases: Sequence[tuple] = _POOL_CASES, reveal: bool = True) -> None:
    """``fn(cfg, gpu, kv_dtype, utilization)``: the tokens of K/V that fit beside the weights, an exact int."""
    for model, gpu, kv_dtype, utilization in cases:
        cfg, spec = _model(model), get_gpu(gpu) if isinstance(gpu, str) else gpu
        quantity = f"pool_tokens({config_label(cfg)}, {spec.name}, kv_dtype={kv_dtype!r}, utilization={utilization})"
        got = call_learner(quantity, fn, cfg, spec, kv_dtype, utilization)
        want = pool_tokens(cfg, spec, kv_dtype, utilization)
        # The slip the lesson's playtest made: the whole memory over the KV per token, the weights left in.
        no_weights = math.floor(utilization * spec.memory_gb * 1e9 / kv_bytes_per_token(cfg, kv_dtype))
        exact_int(
            quantity,
            got,
            want,
            "tokens",
            "Not the pool exercise 1 (section 2) asks for: check the share of memory the server may use, what "
            "takes it first, and the bytes of one token's K/V in kv_dtype.",
            reveal,
            slips=((no_weights, "The weights take their share of the memory first: subtract weight_bytes(cfg)."),),
            to_int="Return an int, rounded down (// or math.floor): a token's K/V fits whole or not at all.",
        )


# -- exercise 2: a step's two terms ---------------------------------------------------------------------------------
def step_terms(
    cfg: ModelConfig, contexts: Sequence[int], kv_dtype: str | None = None, window: int | None = None, sinks: int = 0
) -> dict[str, int]:
    """kvlab's answer: the weights a batch of ``len(contexts)`` reads once, and each row's KV at its own context."""
    kv = sum(kv_bytes_per_step(cfg, c, 1, kv_dtype, window, sinks) for c in contexts)
    return {"weights": weight_bytes_read(cfg, batch=len(contexts)), "kv": kv}


_STEP_CASES = (
    ("llama-3.1-8b", (1200, 30000, 45000), None, None, 0),
    ("llama-3.1-8b", (32768,) * 4, "fp8", 4096, 4),
    ("mixtral-8x7b", (100, 9000), "int8", None, 0),  # MoE: a batch of 2 reads more experts than a batch of 1
    ("gemma-2-9b", (16000, 500), None, None, 0),  # local layers read at most their window
)


def check_step_terms(fn: Callable, cases: Sequence[tuple] = _STEP_CASES, reveal: bool = True) -> None:
    """``fn(cfg, contexts, kv_dtype, window, sinks)``: ``{"weights": int, "kv": int}``, the bytes one decode step
    over a batch at those contexts reads, each term exact."""
    for model, contexts, kv_dtype, window, sinks in cases:
        cfg = _model(model)
        quantity = (
            f"step_terms({config_label(cfg)}, contexts={list(contexts)}, {kv_dtype!r}, window={window}, sinks={sinks})"
        )
        got = call_learner(quantity, fn, cfg, list(contexts), kv_dtype, window, sinks)
        if not isinstance(got, Mapping) or set(got) != set(TERMS):
            fail(quantity, got, f"a dict with exactly the keys {list(TERMS)}", "Return {'weights': ..., 'kv': ...}.")
        want = step_terms(cfg, contexts, kv_dtype, window, sinks)
        per_row_once = kv_bytes_per_step(cfg, max(contexts), len(contexts), kv_dtype, window, sinks)
        exact_int(
            f"{quantity}['weights']",
            got["weights"],
            want["weights"],
            "bytes",
            "The weights are read once per step for the whole batch (a mixture of experts reads the experts its "
            "batch routes to): see exercise 2's text (section 3).",
            reveal,
            slips=((weight_bytes_read(cfg, batch=1) * len(contexts), "Each row does not read the weights again."),),
        )
        exact_int(
            f"{quantity}['kv']",
            got["kv"],
            want["kv"],
            "bytes",
            "Each row reads its own context's K/V, in kv_dtype and under the window and sinks: see exercise 2's "
            "text (section 3).",
            reveal,
            slips=((per_row_once, "The rows are at different contexts: sum each one's, not the longest's x batch."),),
        )


# -- exercise 3: the term that grew ---------------------------------------------------------------------------------
def grown_term(early: Mapping[str, float], late: Mapping[str, float]) -> tuple[str, float]:
    """The term whose ``late / early`` ratio is largest, and that ratio."""
    return max(((t, late[t] / early[t]) for t in TERMS), key=lambda pair: pair[1])


_GROWN_CASES = (
    ({"weights": 16e9, "kv": 2e9}, {"weights": 16e9, "kv": 40e9}),
    ({"weights": 90e9, "kv": 1e9}, {"weights": 140e9, "kv": 1.2e9}),  # a MoE batch that grew: the weights did
    ({"weights": 5e9, "kv": 5e9}, {"weights": 5e9, "kv": 7e9}),
    ({"weights": 15e9, "kv": 0.5e9}, {"weights": 15e9, "kv": 5.5e9}),  # grew 11x, still below the weights
    ({"weights": 60e9, "kv": 2e9}, {"weights": 80e9, "kv": 8e9}),  # the weights added more bytes; the KV grew more
)


def check_grown_term(fn: Callable, cases: Sequence[tuple] = _GROWN_CASES, reveal: bool = True) -> None:
    """``fn(early, late)`` must return ``(term, ratio)``: the key of the term with the largest late/early ratio
    (``"weights"`` or ``"kv"``), and that ratio."""
    for early, late in cases:
        quantity = f"grown_term({dict(early)}, {dict(late)})"
        got = call_learner(quantity, fn, dict(early), dict(late))
        if not isinstance(got, tuple) or len(got) != 2:
            fail(quantity, got, "a tuple (term, ratio)", "Return the term's name and its late / early ratio.")
        want_term, want_ratio = grown_term(early, late)
        if got[0] not in TERMS:
            fail(f"{quantity}[0]", got[0], f"one of {list(TERMS)}", "Name the term by its key.")
        if got[0] != want_term:
            # With two terms the wrong one is also the one an inverted ratio picks; the ratio returned tells the
            # slips apart.
            ratio = got[1] if is_real(got[1]) else math.nan
            by_size = {max(TERMS, key=lambda t: late[t]), max(TERMS, key=lambda t: late[t] - early[t])}
            if got[0] in by_size and math.isclose(ratio, late[got[0]] / early[got[0]], rel_tol=1e-6):
                # Picked by size late or by bytes added (with two terms, a case that tells either from the ratio
                # makes both pick the same term), then divided right.
                slip = (
                    "The term that grew most is not the largest one late, nor the one that added the most bytes: "
                    "a term can grow many times and stay smaller. Pick by the ratio."
                )
            elif math.isclose(ratio, early[got[0]] / late[got[0]], rel_tol=1e-6):
                slip = "Divide late by early, not early by late."
            else:
                slip = "Compare ratios (late / early), not differences: a term can add more bytes and still grow less."
            fail(f"{quantity}[0]", got[0], "term", slip, want_term, reveal)
        close_to(f"{quantity}[1]", got[1], want_ratio, "x", "The ratio is late / early of that term.", reveal)


# -- exercise 4: the fix --------------------------------------------------------------------------------------------
def check_fix(
    fix: Any,
    model: Decoder | None = None,
    seeds: Sequence[int] = PUBLIC_SEEDS,
    incident: Incident = INCIDENT,
    reveal: bool = True,
) -> None:
    """Replay ``fix`` on the incident's traces of ``seeds`` (the SLOs at scale) and on the checkpoint (the floor).

    Nothing the learner computed is trusted: the check measures. With ``reveal`` off it still names what was
    missed (the SLOs and floors are the lesson's own public numbers), but not the measurements on its traces.
    """
    if not isinstance(fix, Fix):
        fail("fix", fix, "a kvlab.course.incident.Fix", "Build it with Fix(prefix_caching=..., kv_dtype=..., ...).")
    try:
        verdict = incident.judge(fix, seeds, model)
    except ValueError as e:
        raise AssertionError(f"fix: {fix.describe()}: the replay refused it: {e}") from None
    q = verdict.quality
    missed = []
    if verdict.p99_tpot_ms > incident.slo_p99_tpot_ms:
        slo = f"{incident.slo_p99_tpot_ms:,g}"
        missed.append(f"P99 TPOT {_shown(verdict.p99_tpot_ms, reveal, ',.1f')} ms > the SLO's {slo} ms")
    if verdict.p99_ttft_ms > incident.slo_p99_ttft_ms:
        slo = f"{incident.slo_p99_ttft_ms:,g}"
        missed.append(f"P99 TTFT {_shown(verdict.p99_ttft_ms, reveal, ',.0f')} ms > the SLO's {slo} ms")
    if q.recall < incident.recall_floor:
        missed.append(
            f"passkey recall {_shown(q.recall, reveal, '.2f')} < the floor's {incident.recall_floor} (a fact "
            f"{incident.horizon:,} tokens back was lost)"
        )
    if q.ppl_ratio > 1 + incident.ppl_tolerance:
        ratio = _shown(q.ppl_ratio, reveal, ".3f")
        missed.append(f"perplexity {ratio} x the full cache's > the floor's {1 + incident.ppl_tolerance}")
    if missed:
        raise AssertionError(
            f"fix ({fix.describe()}): " + "; ".join(missed) + ". Read which lever moves each: the bytes breakdown "
            "for TPOT, what must be prefilled again for TTFT, what the cache drops for recall."
        )


def _shown(value: float, reveal: bool, spec: str) -> str:
    if not is_real(value):
        return repr(value)
    return format(value, spec) if reveal else "(measured on the grader's traces)"
