"""Checkers for the course's exercises: call one on your answer, and it is silent when the answer is right.

A wrong answer raises ``AssertionError`` whose message names the quantity, the form expected (units, an integer
number of bytes, ...) and what to fix. Exact arithmetic is compared exactly, against ``kvlab``'s own functions.
Measured quantities are never compared with one machine's timings: a checker asks instead whether an answer is
consistent with the learner's own measurements, and whether a ratio lies in a band wide enough for any machine
(each band says why it is that wide).

Every checker of a function takes ``cases`` (inputs to try) and ``reveal`` (whether a failure message may show
the expected value). The lessons call them with the defaults; the instructor's hidden checks call the same
checkers on fresh inputs with ``reveal=False``, so feedback never shows an expected value.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from kvlab.bench import RequestTiming, Sweep, fit_line, percentile
from kvlab.cache.base import KVCache
from kvlab.config import ModelConfig
from kvlab.model import Decoder
from kvlab.presets import get_model
from kvlab.roofline import (
    Bandwidth,
    kv_bytes_per_token,
    measure_bandwidth,
    param_count,
    predict_tpot_ms,
    weight_bytes,
)

__all__ = [
    "batch_for_tpot",
    "check_ab_slopes",
    "check_batch_for_tpot",
    "check_concat_cache",
    "check_copy_gbps",
    "check_crossover_context",
    "check_decode_attention_flops",
    "check_decode_flops",
    "check_environment_report",
    "check_error_audit",
    "check_fit_tpot",
    "check_fixed_overhead",
    "check_kv_bytes_per_token",
    "check_measured_copy",
    "check_percentile",
    "check_prefill_flops",
    "check_quick_mode",
    "check_request_metrics",
    "check_ridge_intensity",
    "check_roofline_time_ms",
    "check_slope_band",
    "check_stream_ms",
    "check_tpot_ms",
    "check_weight_bytes",
    "crossover_context",
    "decode_flops",
    "prefill_flops",
    "quick_mode",
    "setup_lesson",
]

REL_TOL = 1e-9  # floats computed by another order of operations differ in the last bits, never by more
_BYTES_DTYPE = {4: "fp32", 2: "bf16", 1: "fp8", 0.5: "int4"}


# -- lesson support -------------------------------------------------------------------------------------------------
def quick_mode(env: Mapping[str, str] | None = None) -> bool:
    """The course's quick mode: ``KVLAB_QUICK`` set to anything but "" or "0", or run by nbgrader at all."""
    env = os.environ if env is None else env
    return env.get("KVLAB_QUICK", "0") not in ("", "0") or "NBGRADER_EXECUTION" in env


def setup_lesson(seed: int = 0) -> bool:
    """What every lesson's setup cell does; returns whether quick mode is on.

    - torch runs on one thread, unless ``OMP_NUM_THREADS`` asks for more outside quick mode. When a machine's cores
      are shared, a multi-threaded operation waits for its slowest thread: on the course's 2-core machine, another
      job's load made a 2-thread decode step 3 to 50 times slower, and the timings meaningless. One thread is slower
      on an idle machine but steady on a busy one, and every prediction uses a bandwidth measured the same way.
    - Under nbgrader, warnings are silenced (a test cell that writes anything to stderr scores zero), and
      tracebacks shrink to their last line (a full one would quote the hidden test code into the feedback).
    - torch is seeded, so a notebook's random inputs repeat from run to run.
    """
    quick = quick_mode()
    if quick or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    if "NBGRADER_EXECUTION" in os.environ:
        warnings.simplefilter("ignore")
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.run_line_magic("xmode", "Minimal")
    torch.manual_seed(seed)
    return quick


# -- reference answers the byte model does not provide --------------------------------------------------------------
def decode_flops(cfg: ModelConfig, context: int, batch: int = 1) -> int:
    """FLOPs of one decode step: 2 per parameter per sequence, plus attention's 4 x context x heads x head dim
    per layer (q.K and p.V, 2 FLOPs per multiply-add each). Dense attention only (not MLA's absorbed form)."""
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
    return batch * (2 * param_count(cfg) + attention)


def prefill_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """FLOPs of a causal prefill of ``n_tokens``: token t attends over t keys, so attention sums to
    2 x layers x heads x head dim x T (T + 1), which is of order 2 T^2 d per layer."""
    attention = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * n_tokens * (n_tokens + 1)
    return 2 * param_count(cfg) * n_tokens + attention


def batch_for_tpot(
    target_ms: float, weight_bytes: float, kv_bytes_per_token: float, context: int, bandwidth_gbps: float
) -> float:
    """The batch at which the two-term model reaches ``target_ms`` (fractional: the model is linear in batch)."""
    return (target_ms / 1e3 * bandwidth_gbps * 1e9 - weight_bytes) / (context * kv_bytes_per_token)


def crossover_context(weight_bytes: float, kv_bytes_per_token: float, batch: int = 1) -> float:
    """Context at which a step's KV bytes equal its weight bytes."""
    return weight_bytes / (batch * kv_bytes_per_token)


# -- message helpers ------------------------------------------------------------------------------------------------
def _fail(quantity: str, got: Any, form: str, fix: str, expected: Any = None, reveal: bool = True) -> None:
    want = f"expected {expected!r} ({form})" if reveal and expected is not None else f"expected {form}"
    raise AssertionError(f"{quantity}: got {got!r}; {want}. {fix}")


def _hint(got: float, want: float, reveal: bool) -> str:
    """Name the classic slips by the ratio they leave behind; empty when none fits, or when the ratio would give
    the withheld expected value away."""
    if not reveal or not want or not isinstance(got, numbers.Real):
        return ""
    hints = {
        0.5: "It is half the expected value: is a factor of 2 missing (K and V, read and write)?",
        2.0: "It is twice the expected value: is a factor of 2 counted twice?",
        8.0: "It is 8 times the expected value: bits instead of bytes?",
        1e3: "It is 1000 times the expected value: check the unit (ms vs s, GB vs MB).",
        1e-3: "It is 1/1000 of the expected value: check the unit (ms vs s, GB vs MB).",
    }
    for ratio, hint in hints.items():
        if math.isclose(got / want, ratio, rel_tol=1e-6):
            return " " + hint
    return ""


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _exact_int(quantity: str, got: Any, want: int, unit: str, fix: str, reveal: bool) -> None:
    if not _is_int(got):
        kind = type(got).__name__
        _fail(quantity, got, f"an int number of {unit}, not a {kind}", "Return an int (round() a fractional count).")
    if got != want:
        _fail(quantity, got, f"an int number of {unit}", fix + _hint(got, want, reveal), want, reveal)


def _close(quantity: str, got: Any, want: float, unit: str, fix: str, reveal: bool, rel: float = REL_TOL) -> None:
    if not _is_real(got) or not math.isfinite(got):
        _fail(quantity, got, f"a finite number in {unit}", "Return a float.")
    if not math.isclose(got, want, rel_tol=rel, abs_tol=1e-12):
        _fail(quantity, got, f"a number in {unit}", fix + _hint(got, want, reveal), want, reveal)


def _call(quantity: str, fn: Callable, *args: Any) -> Any:
    """Call the learner's function; an exception inside it is re-raised with the call that caused it."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise AssertionError(f"{quantity}: not implemented yet; write the function body in the answer cell") from None
    except Exception as e:
        raise AssertionError(f"{quantity}: raised {type(e).__name__}: {e}") from e


def _label(cfg: ModelConfig) -> str:
    return f"{cfg.name} ({cfg.attention_kind}, {cfg.n_layers} layers)"


# -- lesson 00: orientation -----------------------------------------------------------------------------------------
_QUICK_CASES: tuple[dict[str, str], ...] = (
    {},
    {"KVLAB_QUICK": "1"},
    {"KVLAB_QUICK": "0"},
    {"NBGRADER_EXECUTION": "autograde"},
    {"KVLAB_QUICK": "0", "NBGRADER_EXECUTION": "validate"},
    {"HOME": "/home/me"},
)


def check_quick_mode(fn: Callable[[Mapping[str, str]], bool], cases=_QUICK_CASES, reveal: bool = True) -> None:
    """``fn(env)`` -> whether a notebook run with environment ``env`` should use quick mode."""
    for env in cases:
        got = _call(f"quick_mode({env})", fn, dict(env))
        if not isinstance(got, bool):
            _fail(f"quick_mode({env})", got, "a bool", "Return True or False.")
        if got != quick_mode(env):
            fix = 'Quick mode is on when KVLAB_QUICK is set to anything but "" or "0", or NBGRADER_EXECUTION is set.'
            _fail(f"quick_mode({env})", got, "a bool", fix, quick_mode(env), reveal)


_COPY_CASES = ((256e6, 0.02), (1_000_000, 1e-4), (4096, 2.5e-7))


def check_copy_gbps(fn: Callable[[float, float], float], cases=_COPY_CASES, reveal: bool = True) -> None:
    """``fn(n_bytes, seconds)`` -> copy bandwidth in GB/s when copying ``n_bytes`` took ``seconds``."""
    for n_bytes, seconds in cases:
        fix = "A copy reads n bytes and writes n bytes; GB/s means 1e9 bytes per second."
        _close(
            f"copy_gbps({n_bytes:g}, {seconds:g})",
            _call("copy_gbps", fn, n_bytes, seconds),
            2 * n_bytes / seconds / 1e9,
            "GB/s",
            fix,
            reveal,
        )


def check_measured_copy(gbps: float, times_s: Sequence[float], n_bytes: int) -> None:
    """Your CPU copy bandwidth: the median of your own timings, and within a factor 3 of kvlab's measurement.

    The band: two measurements of one buffer in one process differ by run-to-run noise (±20% on the course's
    machine) and by the timing method; a factor 3 either way flags a unit slip or a missing warm-up (the first
    copy also pays for fresh pages), not noise.
    """
    if len(times_s) < 5:
        _fail("copy timings", len(times_s), "at least 5 timed repeats", "Time more repeats after the warm-up.")
    own = 2 * n_bytes / percentile(list(times_s), 50) / 1e9
    _close("my_copy_gbps", gbps, own, "GB/s", "Use copy_gbps(n_bytes, median of your timings).", True, rel=1e-6)
    ref = measure_bandwidth("cpu", size_mb=n_bytes / 1e6, repeats=5).copy_gbps
    if not 1 / 3 <= gbps / ref <= 3:
        _fail(
            "my_copy_gbps",
            round(gbps, 2),
            f"within 3x of kvlab's {ref:.2f} GB/s measured just now",
            "Warm up once before timing, time only the copy, and take the median.",
        )


_STREAM_CASES = ((141.1e9, 3350.0), (9.83e9, 3350.0), (22_029_312, 12.5))


def check_stream_ms(fn: Callable[[float, float], float], cases=_STREAM_CASES, reveal: bool = True) -> None:
    """``fn(n_bytes, bandwidth_gbps)`` -> ms to stream ``n_bytes`` once at ``bandwidth_gbps``."""
    for n_bytes, gbps in cases:
        fix = "Time = bytes / (GB/s x 1e9) seconds; return milliseconds."
        _close(
            f"stream_ms({n_bytes:g}, {gbps:g})",
            _call("stream_ms", fn, n_bytes, gbps),
            predict_tpot_ms(n_bytes, gbps),
            "ms",
            fix,
            reveal,
        )


def check_environment_report(report: Mapping[str, Any], bandwidth: Bandwidth) -> None:
    """The environment report: device, torch threads, and the copy bandwidth kvlab measured in this run."""
    for key in ("device", "threads", "copy_gbps"):
        if key not in report:
            _fail("report", sorted(report), f"a dict with the key {key!r}", "Add device, threads and copy_gbps.")
    if str(report["device"]) != bandwidth.device:
        _fail(
            "report['device']",
            report["device"],
            f"the device measured on, {bandwidth.device!r}",
            "Use the device kvlab measured the bandwidth on.",
        )
    if report["threads"] != torch.get_num_threads():
        _fail("report['threads']", report["threads"], "torch.get_num_threads()", "Read it from torch.")
    if report["copy_gbps"] != bandwidth.copy_gbps:
        _fail(
            "report['copy_gbps']",
            report["copy_gbps"],
            "the measured bandwidth's copy_gbps",
            "Use the Bandwidth object measured above.",
        )


# -- lesson 01: bytes per step --------------------------------------------------------------------------------------
def _course_models() -> tuple[tuple[ModelConfig, float], ...]:
    return (
        (get_model("llama-3.1-70b"), 2),
        (get_model("llama-2-7b"), 2),
        (get_model("cpu-tiny"), 4),
        (get_model("llama-3.1-8b").replace(n_kv_heads=1, name="llama-3.1-8b-mqa"), 2),
        (get_model("deepseek-v3"), 2),
        (get_model("qwen3-8b"), 0.5),
    )


def check_kv_bytes_per_token(
    fn: Callable[[ModelConfig, float], int],
    cases: Iterable[tuple[ModelConfig, float]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, bytes_per_element)`` -> bytes one token of one sequence caches, all layers, K and V."""
    for cfg, size in _course_models() if cases is None else cases:
        want = kv_bytes_per_token(cfg, _BYTES_DTYPE[size])
        fix = (
            "Per layer a token stores K and V for each KV head: 2 x kv_heads x head_dim elements; "
            "MLA stores one latent of kv_lora_rank + qk_rope_head_dim elements instead."
        )
        got = _call(f"kv_bytes_per_token({_label(cfg)}, {size})", fn, cfg, size)
        _exact_int(f"kv_bytes_per_token({_label(cfg)}, bytes_per_element={size})", got, want, "bytes", fix, reveal)


def _dense_models() -> tuple[tuple[ModelConfig, float], ...]:
    return (
        (get_model("llama-3.1-70b"), 2),
        (get_model("cpu-tiny"), 4),
        (get_model("smollm2-135m"), 2),
        (get_model("qwen2.5-7b"), 1),
    )


def check_weight_bytes(
    fn: Callable[[ModelConfig, float], int],
    cases: Iterable[tuple[ModelConfig, float]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, bytes_per_element)`` -> bytes of all parameters of a Llama-style shape, counted from the shape."""
    for cfg, size in _dense_models() if cases is None else cases:
        want = weight_bytes(cfg, _BYTES_DTYPE[size])
        fix = (
            "Count embeddings (twice unless tied: input table and output head), per layer the Q, K, V, O projections "
            "(d x heads x head_dim for Q and O, d x kv_heads x head_dim for K and V), three d x d_ff MLP matrices "
            "and two norms of d, plus the final norm."
        )
        got = _call(f"weight_bytes({_label(cfg)}, {size})", fn, cfg, size)
        _exact_int(f"weight_bytes({_label(cfg)}, bytes_per_element={size})", got, want, "bytes", fix, reveal)


_TPOT_CASES = (
    (141_107_412_992, 327_680, 30_000, 1, 3350.0),
    (141_107_412_992, 327_680, 30_000, 26, 3350.0),
    (22_029_312, 8192, 4096, 4, 12.5),
)


def check_tpot_ms(fn: Callable[..., float], cases=_TPOT_CASES, reveal: bool = True) -> None:
    """``fn(weight_bytes, kv_bytes_per_token, context, batch, bandwidth_gbps)`` -> predicted TPOT in ms."""
    for w, kv, context, batch, gbps in cases:
        want = predict_tpot_ms(w + batch * context * kv, gbps)
        fix = "TPOT = (weight bytes + batch x context x KV bytes per token) / (bandwidth in bytes/s), in ms."
        label = f"tpot_ms({w}, {kv}, context={context}, batch={batch}, {gbps:g} GB/s)"
        _close(label, _call(label, fn, w, kv, context, batch, gbps), want, "ms", fix, reveal)


_BATCH_CASES = (
    (120.0, 141_107_412_992, 327_680, 30_000, 3350.0),
    (50.0, 16_000_000_000, 131_072, 8192, 2039.0),
)


def check_batch_for_tpot(fn: Callable[..., float], cases=_BATCH_CASES, reveal: bool = True) -> None:
    """``fn(target_ms, weight_bytes, kv_bytes_per_token, context, bandwidth_gbps)`` -> batch (a float)."""
    for target, w, kv, context, gbps in cases:
        label = f"batch_for_tpot({target:g} ms, {w}, {kv}, {context}, {gbps:g} GB/s)"
        fix = "Solve target = (weights + batch x context x KV per token) / bandwidth for batch; keep it fractional."
        _close(
            label,
            _call(label, fn, target, w, kv, context, gbps),
            batch_for_tpot(target, w, kv, context, gbps),
            "sequences",
            fix,
            reveal,
        )


def check_error_audit(expression_bytes: int, mha_kv_bytes_32k: int, gqa8_kv_bytes_32k: int) -> None:
    """The circulating claim about Llama-3.1-70B's KV cache at 32k tokens, audited.

    ``expression_bytes``: what ``2 x 80 x 8192 x 32 x 2`` really equals; the other two: the KV bytes one sequence
    caches at 32,768 tokens in BF16 with 64 KV heads (MHA) and with 8 (GQA-8, the real model).
    """
    cfg = get_model("llama-3.1-70b")
    context = 32_768
    _exact_int(
        "expression_bytes",
        expression_bytes,
        2 * 80 * 8192 * 32 * 2,
        "bytes",
        "Evaluate the expression as written: it has no sequence length in it.",
        True,
    )
    mha = cfg.replace(n_kv_heads=cfg.n_heads, name="llama-3.1-70b-mha")
    fix = "KV bytes = 2 x layers x kv_heads x head_dim x bytes per element x tokens."
    _exact_int("mha_kv_bytes_32k", mha_kv_bytes_32k, kv_bytes_per_token(mha) * context, "bytes", fix, True)
    _exact_int("gqa8_kv_bytes_32k", gqa8_kv_bytes_32k, kv_bytes_per_token(cfg) * context, "bytes", fix, True)


_ATTN_FLOP_CASES = ((80, 8192, 32_768), (32, 4096, 1), (4, 256, 4096))


def check_decode_attention_flops(
    fn: Callable[[int, int, int], int], cases=_ATTN_FLOP_CASES, reveal: bool = True
) -> None:
    """``fn(n_layers, d_model, context)`` -> attention FLOPs of one decode step (one new token, one sequence)."""
    for layers, d, context in cases:
        label = f"decode_attention_flops({layers}, {d}, {context})"
        fix = (
            "One new query against `context` keys: q.K is 2 x context x d FLOPs and p.V another 2 x context x d, "
            "per layer. There is no context^2: the past queries are not recomputed."
        )
        _exact_int(label, _call(label, fn, layers, d, context), 4 * layers * d * context, "FLOPs", fix, reveal)


# -- lesson 02: roofline --------------------------------------------------------------------------------------------
_RIDGE_CASES = ((989e12, 3350.0), (312e12, 2039.0), (50e9, 12.5))


def check_ridge_intensity(fn: Callable[[float, float], float], cases=_RIDGE_CASES, reveal: bool = True) -> None:
    """``fn(peak_flops_per_s, bandwidth_gbps)`` -> the ridge point in FLOPs per byte."""
    for peak, gbps in cases:
        label = f"ridge_intensity({peak:g} FLOP/s, {gbps:g} GB/s)"
        fix = "The ridge is where compute time equals memory time: peak FLOP/s / (bandwidth in bytes/s)."
        _close(label, _call(label, fn, peak, gbps), peak / (gbps * 1e9), "FLOP/byte", fix, reveal)


def _flop_models() -> tuple[ModelConfig, ...]:
    return get_model("llama-3.1-8b"), get_model("cpu-tiny"), get_model("qwen3-8b")


def check_decode_flops(fn: Callable[[ModelConfig, int, int], int], cases=None, reveal: bool = True) -> None:
    """``fn(cfg, context, batch)`` -> FLOPs of one decode step for the whole batch."""
    cases = [(cfg, ctx, b) for cfg in _flop_models() for ctx, b in ((4096, 1), (1, 16))] if cases is None else cases
    for cfg, context, batch in cases:
        label = f"decode_flops({_label(cfg)}, context={context}, batch={batch})"
        fix = "Per sequence: 2 FLOPs per parameter, plus 4 x context x heads x head_dim per layer for attention."
        _exact_int(
            label, _call(label, fn, cfg, context, batch), decode_flops(cfg, context, batch), "FLOPs", fix, reveal
        )


def check_prefill_flops(fn: Callable[[ModelConfig, int], int], cases=None, reveal: bool = True) -> None:
    """``fn(cfg, n_tokens)`` -> FLOPs of a causal prefill of ``n_tokens`` for one sequence."""
    cases = [(cfg, t) for cfg in _flop_models() for t in (1, 4096)] if cases is None else cases
    for cfg, n in cases:
        label = f"prefill_flops({_label(cfg)}, n_tokens={n})"
        fix = (
            "2 FLOPs per parameter per token, plus attention: token t (t = 1..T) attends over t keys at 4 x heads "
            "x head_dim FLOPs per key per layer, a sum of 2 x layers x heads x head_dim x T (T + 1)."
        )
        _exact_int(label, _call(label, fn, cfg, n), prefill_flops(cfg, n), "FLOPs", fix, reveal)


_ROOFLINE_CASES = ((2e9, 4e9, 50e9, 12.5), (2e12, 1e9, 50e9, 12.5), (1.4e11, 1.4e11, 989e12, 3350.0))


def check_roofline_time_ms(
    fn: Callable[[float, float, float, float], float], cases=_ROOFLINE_CASES, reveal: bool = True
) -> None:
    """``fn(flops, n_bytes, peak_flops_per_s, bandwidth_gbps)`` -> the roofline's time in ms."""
    for flops, n_bytes, peak, gbps in cases:
        label = f"roofline_time_ms({flops:g} FLOPs, {n_bytes:g} B, {peak:g} FLOP/s, {gbps:g} GB/s)"
        want = max(flops / peak, n_bytes / (gbps * 1e9)) * 1e3
        fix = "The slower of the two: max(FLOPs / peak, bytes / bandwidth), in ms (not their sum)."
        _close(label, _call(label, fn, flops, n_bytes, peak, gbps), want, "ms", fix, reveal)


def check_fixed_overhead(
    overhead_ms: float, measured_ms: float, predicted_ms: float, n_bytes: float, bandwidth_gbps: float
) -> None:
    """The per-step cost the byte model leaves out, from your own measurement of a model too small to stream.

    Consistency: ``predicted_ms`` is the bytes-only prediction and ``overhead_ms`` your measured step minus it.
    Band: the micro model's bytes stream in a few microseconds, while dispatching its dozens of PyTorch operations
    takes tens of microseconds or more on any CPU or GPU, so the overhead must be at least half the measured step.
    """
    _close(
        "micro_predicted_ms",
        predicted_ms,
        predict_tpot_ms(n_bytes, bandwidth_gbps),
        "ms",
        "Bytes / (copy bandwidth in bytes/s), in ms.",
        True,
        rel=1e-6,
    )
    _close(
        "fixed_overhead_ms",
        overhead_ms,
        measured_ms - predicted_ms,
        "ms",
        "Subtract the bytes' prediction from the measured step time.",
        True,
        rel=1e-6,
    )
    if not overhead_ms >= 0.5 * measured_ms:
        _fail(
            "fixed_overhead_ms",
            overhead_ms,
            f"at least half the measured {measured_ms:.3f} ms",
            "Measure the micro model's step again: its bytes should explain almost none of it.",
        )


# -- lesson 03: measuring TPOT --------------------------------------------------------------------------------------
_REQUEST_CASES = ((0.120, 0.150, 0.185, 0.215), (0.5, 0.51), (0.0312, 0.0401, 0.0499, 0.0588, 0.0702, 0.0789))


def check_request_metrics(
    fn: Callable[[Sequence[float]], Mapping[str, Any]], cases=_REQUEST_CASES, reveal: bool = True
) -> None:
    """``fn(token_times_s)`` -> {"ttft_ms", "tpot_ms", "itl_ms" (a list), "e2el_ms"} for one request."""
    for times in cases:
        ref = RequestTiming(tuple(times))
        got = _call(f"request_metrics({list(times)})", fn, list(times))
        if not isinstance(got, Mapping):
            _fail("request_metrics", got, "a dict", "Return a dict with ttft_ms, tpot_ms, itl_ms and e2el_ms.")
        for key, want, fix in (
            ("ttft_ms", ref.ttft_ms, "TTFT is the first token's arrival time since the request started."),
            ("tpot_ms", ref.tpot_ms, "TPOT = (E2EL - TTFT) / (tokens - 1): the first token is not a decode gap."),
            ("e2el_ms", ref.e2el_ms, "E2EL is the last token's arrival time since the request started."),
        ):
            _close(f"request_metrics({list(times)})[{key!r}]", got.get(key), want, "ms", fix, reveal)
        itl = got.get("itl_ms")
        fix = "ITL is every gap between consecutive tokens: one fewer than the tokens, in ms."
        if not isinstance(itl, Sequence) or len(itl) != len(ref.itl_ms):
            _fail(f"request_metrics({list(times)})['itl_ms']", itl, f"a list of {len(ref.itl_ms)} gaps in ms", fix)
        for got_gap, want_gap in zip(itl, ref.itl_ms, strict=True):
            _close(f"request_metrics({list(times)})['itl_ms']", got_gap, want_gap, "ms", fix, reveal)


_PERCENTILE_CASES = (((3.0, 1.0, 2.0), 50), ((5.0, 1.0, 4.0, 2.0, 3.0), 90), ((10.0, 20.0), 99), ((7.0,), 99))


def check_percentile(
    fn: Callable[[Sequence[float], float], float], cases=_PERCENTILE_CASES, reveal: bool = True
) -> None:
    """``fn(values, p)`` -> the p-th percentile, linearly interpolated between the sorted values."""
    for values, p in cases:
        label = f"percentile({list(values)}, {p})"
        fix = "Sort; rank = (n - 1) x p / 100; interpolate between the values at floor(rank) and ceil(rank)."
        _close(label, _call(label, fn, list(values), p), percentile(values, p), "the values' unit", fix, reveal)


def check_fit_tpot(
    fn: Callable[[Sequence[int], Sequence[float]], tuple[float, float]],
    sweep: Sweep | None = None,
    cases: Iterable[tuple[Sequence[int], Sequence[float]]] = (),
    reveal: bool = True,
) -> None:
    """``fn(contexts, tpot_ms)`` -> (slope in µs per token, intercept in ms) of the least-squares line.

    With a ``sweep``, the fit must match a fit of that sweep's own points: the check is consistency with your
    data, never a particular machine's numbers.
    """
    data = [([p.context for p in sweep.points], [p.tpot_ms for p in sweep.points])] if sweep is not None else []
    for contexts, tpots in [*data, *cases]:
        got = _call("fit_tpot", fn, list(contexts), list(tpots))
        if not (isinstance(got, tuple) and len(got) == 2):
            _fail("fit_tpot", got, "a tuple (slope_us_per_token, intercept_ms)", "Return two numbers.")
        ref = fit_line(contexts, tpots)
        fix = "Least squares: slope = cov(x, y) / var(x), intercept = mean(y) - slope x mean(x)."
        _close("fit_tpot slope", got[0], ref.slope * 1e3, "µs per token (TPOT is in ms)", fix, reveal, rel=1e-6)
        _close("fit_tpot intercept", got[1], ref.intercept, "ms", fix, reveal, rel=1e-6)


# The plausible band for a measured KV slope against bytes / copy bandwidth. Below 1/4 would mean reading the cache
# at more than 4x the copy bandwidth, which even the last-level cache does not reach (on the course's CPU, in-cache
# copies ran about 2x DRAM). Above 4 means under a quarter of copy bandwidth, where a decoder whose cache is laid
# out for streaming does not fall (PERFORMANCE_NOTES: 45% for a plain decoder, about 90% key-major); a slope that
# steep means extra work per cached token, such as a cache that copies itself.
SLOPE_BAND = (0.25, 4.0)


def check_slope_band(predicted_slope_us: float, measured_slope_us: float, sweep: Sweep) -> None:
    """The predicted KV slope (bytes / measured bandwidth), and the measured one within ``SLOPE_BAND`` of it."""
    want = sweep.batch * sweep.kv_bytes_per_token / (sweep.bandwidth.copy_gbps * 1e9) * 1e6
    _close(
        "predicted_slope_us",
        predicted_slope_us,
        want,
        "µs per token",
        "KV bytes per token x batch / (measured copy GB/s x 1e9), in microseconds.",
        True,
        rel=1e-6,
    )
    _close(
        "measured_slope_us",
        measured_slope_us,
        sweep.fit.slope * 1e3,
        "µs per token",
        "Use your fit of this sweep's points (slope in µs per token).",
        True,
        rel=1e-6,
    )
    low, high = SLOPE_BAND
    ratio = measured_slope_us / predicted_slope_us
    if not low <= ratio <= high:
        _fail(
            "measured / predicted slope",
            round(ratio, 3),
            f"between {low} and {high}",
            "Re-run the sweep on a quiet machine; if it stays outside, something reads or copies more per token.",
        )


_CROSSOVER_CASES = ((139_006_083_072, 327_680, 1), (17_836_032, 8192, 1), (139_006_083_072, 327_680, 26))


def check_crossover_context(
    fn: Callable[[float, float, int], float], cases=_CROSSOVER_CASES, reveal: bool = True
) -> None:
    """``fn(weight_bytes, kv_bytes_per_token, batch)`` -> context (tokens) where KV bytes equal weight bytes."""
    for w, kv, batch in cases:
        label = f"crossover_context({w}, {kv}, batch={batch})"
        fix = "Solve batch x context x KV per token = weight bytes for context; keep it fractional."
        _close(label, _call(label, fn, w, kv, batch), crossover_context(w, kv, batch), "tokens", fix, reveal)


_CACHE_CHECK_MODEL = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64)


def check_concat_cache(
    make_cache: Callable[[Decoder, int, int], KVCache],
    cfg: ModelConfig = _CACHE_CHECK_MODEL,
    batch: int = 2,
    n_steps: int = 6,
) -> None:
    """A cache from ``make_cache(model, batch, capacity)`` must decode exactly what the preallocated cache does."""
    model = Decoder(cfg, seed=1)
    prompt = torch.randint(0, cfg.vocab_size, (batch, 5), generator=torch.Generator().manual_seed(2))
    caches = {
        "preallocated": model.new_cache(batch, 5 + n_steps),
        "yours": _call("make_cache", make_cache, model, batch, 5 + n_steps),
    }

    def decode(cache: KVCache) -> torch.Tensor:
        out = [model.prefill(prompt, cache)[:, -1]]
        for _ in range(n_steps):
            out.append(model.decode_step(out[-1].argmax(-1), cache))
        return torch.stack(out)

    logits = {
        "preallocated": decode(caches["preallocated"]),
        "yours": _call("decoding with your cache", decode, caches["yours"]),
    }
    if caches["yours"].length != 5 + n_steps:
        _fail(
            "cache.length",
            caches["yours"].length,
            f"{5 + n_steps} after a 5-token prefill and {n_steps} steps",
            "reserve() must advance the length by the new tokens.",
        )
    mismatched = [
        step
        for step, (a, b) in enumerate(zip(logits["yours"], logits["preallocated"], strict=True))
        if not torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    ]
    if mismatched:
        step = mismatched[0]
        _fail(
            "decoded logits",
            f"a mismatch from output token {step + 1} on",
            "the preallocated cache's logits",
            "append() must add the new K/V after the stored ones along the token axis, in the stored layout.",
        )


# Why 1.5: a cache grown by concatenation reads all its stored K/V and writes a new copy every step, on top of the
# read that attention does, so it moves about 3x the bytes per cached token; 1.5 leaves a factor 2 for noise.
AB_MIN_RATIO = 1.5


def check_ab_slopes(preallocated: Sweep, concat: Sweep) -> None:
    """The concatenating cache's slope must be steeper, measured in one process against one bandwidth."""
    for name, sweep in (("preallocated", preallocated), ("concat", concat)):
        if not isinstance(sweep, Sweep):
            _fail(name, type(sweep).__name__, "a kvlab.bench.Sweep", "Pass the result of sweep_context.")
    if preallocated.bandwidth is not concat.bandwidth:
        _fail(
            "bandwidth",
            "two different measurements",
            "one Bandwidth object shared by both sweeps",
            "Measure the bandwidth once and pass it to both sweeps, in this kernel.",
        )
    a, b = [p.context for p in preallocated.points], [p.context for p in concat.points]
    if a != b:
        _fail("concat contexts", b, f"the preallocated sweep's contexts {a}", "Sweep the same contexts.")
    ratio = concat.fit.slope / preallocated.fit.slope
    if not ratio >= AB_MIN_RATIO:
        _fail(
            "concat slope / preallocated slope",
            round(ratio, 2),
            f"at least {AB_MIN_RATIO}",
            "A cache grown by torch.cat copies itself every step; does your append() concatenate?",
        )
