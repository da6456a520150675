"""Lesson 02, roofline: the ridge point, decode and prefill FLOPs, the roofline's time, the fixed per-step overhead
measured on a model too small to stream, the share of bandwidth published decode runs reached, and the bytes of
int8 weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvlab.course.grading import call_learner, close_to, config_label, exact_int, fail
from kvlab.model.weights import int8_step_weight_bytes
from kvlab.roofline import decode_flops, predict_tpot_ms, prefill_flops, ridge_intensity, roofline_time_ms
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import get_model
from kvlab.spec.published import PublishedDecode, published_decode

__all__ = [
    "check_achieved_fraction",
    "check_decode_flops",
    "check_fixed_overhead",
    "check_int8_weight_bytes",
    "check_prefill_flops",
    "check_ridge_intensity",
    "check_roofline_time_ms",
]

_RIDGE_CASES = ((989e12, 3350.0), (312e12, 2039.0), (50e9, 12.5))


def check_ridge_intensity(fn: Callable[[float, float], float], cases=_RIDGE_CASES, reveal: bool = True) -> None:
    """``fn(peak_flops_per_s, bandwidth_gbps)`` -> the ridge point in FLOPs per byte."""
    for peak, gbps in cases:
        label = f"ridge_intensity({peak:g} FLOP/s, {gbps:g} GB/s)"
        fix = "The ridge is where compute time equals memory time: peak FLOP/s / (bandwidth in bytes/s)."
        close_to(label, call_learner(label, fn, peak, gbps), ridge_intensity(peak, gbps), "FLOP/byte", fix, reveal)


def _flop_models() -> tuple[ModelConfig, ...]:
    return get_model("llama-3.1-8b"), get_model("cpu-tiny"), get_model("qwen3-8b"), get_model("mixtral-8x7b")


def check_decode_flops(fn: Callable[[ModelConfig, int, int], int], cases=None, reveal: bool = True) -> None:
    """``fn(cfg, context, batch)`` -> FLOPs of one decode step for the whole batch."""
    cases = [(cfg, ctx, b) for cfg in _flop_models() for ctx, b in ((4096, 1), (1, 16))] if cases is None else cases
    for cfg, context, batch in cases:
        label = f"decode_flops({config_label(cfg)}, context={context}, batch={batch})"
        fix = (
            "Per sequence: 2 FLOPs per parameter a token uses (roofline.active_params(cfg): a mixture of experts "
            "uses only its routed experts), plus 4 x context x query heads x head_dim per layer for attention."
        )
        exact_int(
            label, call_learner(label, fn, cfg, context, batch), decode_flops(cfg, context, batch), "FLOPs", fix, reveal
        )


def check_prefill_flops(fn: Callable[[ModelConfig, int], int], cases=None, reveal: bool = True) -> None:
    """``fn(cfg, n_tokens)`` -> FLOPs of a causal prefill of ``n_tokens`` for one sequence."""
    cases = [(cfg, t) for cfg in _flop_models() for t in (1, 4096)] if cases is None else cases
    for cfg, n in cases:
        label = f"prefill_flops({config_label(cfg)}, n_tokens={n})"
        fix = (
            "2 FLOPs per parameter a token uses (roofline.active_params(cfg)) per token, plus attention: token t "
            "(t = 1..T) attends over t keys at 4 x query heads x head_dim FLOPs per key per layer, a sum of "
            "2 x layers x heads x head_dim x T (T + 1)."
        )
        exact_int(label, call_learner(label, fn, cfg, n), prefill_flops(cfg, n), "FLOPs", fix, reveal)


_ROOFLINE_CASES = ((2e9, 4e9, 50e9, 12.5), (2e12, 1e9, 50e9, 12.5), (1.4e11, 1.4e11, 989e12, 3350.0))


def check_roofline_time_ms(
    fn: Callable[[float, float, float, float], float], cases=_ROOFLINE_CASES, reveal: bool = True
) -> None:
    """``fn(flops, n_bytes, peak_flops_per_s, bandwidth_gbps)`` -> the roofline's time in ms."""
    for flops, n_bytes, peak, gbps in cases:
        label = f"roofline_time_ms({flops:g} FLOPs, {n_bytes:g} B, {peak:g} FLOP/s, {gbps:g} GB/s)"
        want = roofline_time_ms(flops, n_bytes, peak, gbps)
        fix = "The slower of the two: max(FLOPs / peak, bytes / bandwidth), in ms (not their sum)."
        close_to(label, call_learner(label, fn, flops, n_bytes, peak, gbps), want, "ms", fix, reveal)


def check_fixed_overhead(
    overhead_ms: float, measured_ms: float, predicted_ms: float, n_bytes: float, bandwidth_gbps: float
) -> None:
    """The per-step cost the byte model leaves out, from your own measurement of a model too small to stream.

    Consistency: ``predicted_ms`` is the byte model's prediction (``n_bytes`` at the read bandwidth
    ``bandwidth_gbps``) and ``overhead_ms`` your measured step minus it.
    Band: lesson 02's micro model is sized so that its bytes (about 20 kB) stream in about a microsecond at any
    machine's memory bandwidth, and sit in a cache besides, while dispatching its dozens of PyTorch operations takes
    tens of microseconds or more on any CPU or GPU; so the overhead must be at least half the measured step. (On the
    course's loaded 2-core machine, 50 quick-mode runs put it at 95-99% of the step.)
    """
    close_to(
        "micro_predicted_ms",
        predicted_ms,
        predict_tpot_ms(n_bytes, bandwidth_gbps),
        "ms",
        "Bytes / (read bandwidth in bytes/s), in ms.",
        True,
        rel=1e-6,
    )
    close_to(
        "fixed_overhead_ms",
        overhead_ms,
        measured_ms - predicted_ms,
        "ms",
        "Subtract the bytes' prediction from the measured step time.",
        True,
        rel=1e-6,
    )
    if not overhead_ms >= 0.5 * measured_ms:
        fail(
            "fixed_overhead_ms",
            overhead_ms,
            f"at least half the measured {measured_ms:.3f} ms",
            "Measure the micro model's step again: its bytes should explain almost none of it.",
        )


def check_achieved_fraction(
    fn: Callable[[PublishedDecode], float], cases: Iterable[PublishedDecode] | None = None, reveal: bool = True
) -> None:
    """``fn(row)`` -> byte-model TPOT at the row's datasheet bandwidth / the row's measured TPOT."""
    for row in published_decode() if cases is None else cases:
        label = f"achieved_fraction({row.model}, {row.weight_dtype}, {row.device}, batch={row.batch})"
        n_bytes = row.weight_bytes + row.batch * row.context * row.kv_bytes_per_token
        want = predict_tpot_ms(n_bytes, row.bandwidth_gbps) / row.measured_tpot_ms
        fix = (
            "Predicted TPOT = (weight bytes + batch x context x KV bytes per token) / (bandwidth x 1e9), in ms; "
            "divide it by the measured TPOT (a fraction below 1)."
        )
        close_to(label, call_learner(label, fn, row), want, "a fraction of the bandwidth", fix, reveal)


def check_int8_weight_bytes(fn: Callable[[ModelConfig], int], cases=None, reveal: bool = True) -> None:
    """``fn(cfg)`` -> bytes of the matrices a decode step multiplies by, stored int8 with one fp32 scale per output
    column (``kvlab.model.weights``'s format): exact arithmetic, no measurement."""
    cases = (get_model("cpu-small"), get_model("cpu-tiny"), get_model("llama-3.1-8b")) if cases is None else cases
    for cfg in cases:
        label = f"int8_weight_bytes({config_label(cfg)})"
        fix = (
            "Per layer: the QKV matrix (d_model in; query heads + 2 x KV heads, times head_dim, out), the output "
            "projection, gate/up (2 x d_ff out) and down; then the LM head (d_model in, vocab out). Each matrix "
            "costs 1 byte per weight plus a 4-byte scale per output channel (a column of the [in, out] matrix); the "
            "input embedding is a lookup, not a product."
        )
        exact_int(label, call_learner(label, fn, cfg), int8_step_weight_bytes(cfg), "bytes", fix, reveal)
