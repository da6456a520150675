"""Lessons 00 and 01's checkers, and the message helpers every checker shares: right work passes, and each wrong
answer is told its own fault (never a type it already has, never a slip whose cause is unlikely)."""

from __future__ import annotations

import math
import re

import pytest

from autograde import hidden
from kvlab import checks, get_model
from kvlab.course import grading, lesson00_orientation, lesson01_bytes_per_step
from kvlab.machine.timing import Bandwidth
from tests.helpers import assert_fails


# -- reference answers, written from the lessons' text ------------------------------------------------------------
def quick(env):
    return env.get("KVLAB_QUICK", "0") not in ("", "0") or "NBGRADER_EXECUTION" in env


def kv_elements(cfg):
    return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim if cfg.mla else 2 * cfg.n_kv_heads * cfg.head_dim


def kv_bytes(cfg, size):
    return round(cfg.n_layers * kv_elements(cfg) * size)


def params(cfg):
    d = cfg.d_model
    layer = 2 * d * cfg.n_heads * cfg.head_dim + 2 * d * cfg.n_kv_heads * cfg.head_dim + 3 * d * cfg.d_ff + 2 * d
    return cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * layer + d


def weight_bytes(cfg, size):
    return round(params(cfg) * size)


def audit(cfg, context):
    mha = kv_bytes(cfg.replace(n_kv_heads=cfg.n_heads), 2) * context
    own = kv_bytes(cfg, 2) * context
    return {"mha_kv_bytes": mha, "kv_bytes": own, "kv_over_weights": own / weight_bytes(cfg, 2)}


EXPRESSION = 83_886_080  # 2 x 80 x 8192 x 32 x 2, multiplied out by hand: 1280 x 8192 = 10,485,760; x 8


# -- quick mode: the stated rule, and only it ----------------------------------------------------------------------
NEAR_MISSES = {
    "KVLAB_QUICK present": lambda env: "KVLAB_QUICK" in env or "NBGRADER_EXECUTION" in env,
    "KVLAB_QUICK == '1'": lambda env: env.get("KVLAB_QUICK") == "1" or "NBGRADER_EXECUTION" in env,
    "KVLAB_QUICK != '0'": lambda env: env.get("KVLAB_QUICK", "0") != "0" or "NBGRADER_EXECUTION" in env,
    "NBGRADER truthy": lambda env: env.get("KVLAB_QUICK", "0") not in ("", "0") or bool(env.get("NBGRADER_EXECUTION")),
    "KVLAB_QUICK=0 wins": lambda env: env.get("KVLAB_QUICK") != "0" and quick(env),
}


def test_quick_mode_right_rule_passes_public_and_hidden():
    checks.check_quick_mode(quick)
    hidden.check_quick_mode(quick)


@pytest.mark.parametrize("rule", NEAR_MISSES.values(), ids=NEAR_MISSES)
def test_quick_mode_near_misses_fail_public_and_hidden(rule):
    assert_fails(checks.check_quick_mode, rule, match="quick_mode")
    assert_fails(hidden.check_quick_mode, rule, match="quick_mode")


def test_quick_mode_message_names_the_case_at_fault():
    message = assert_fails(checks.check_quick_mode, NEAR_MISSES["NBGRADER truthy"], match="NBGRADER_EXECUTION")
    assert 'even ""' in message and "expected True" in message


# -- rounding: the text says round, and both checks can tell -------------------------------------------------------
def test_odd_shapes_are_fractional_on_both_sides_of_a_half():
    # 5 layers x 2 x 1 KV head x 62 x 0.5625 = 348.75; with 58, 326.25 (hand-multiplied)
    assert [cfg.n_layers * kv_elements(cfg) * 0.5625 for cfg in lesson01_bytes_per_step._ODD_SHAPES] == [348.75, 326.25]


ROUNDING_SLIPS = {
    "kv floor": (checks.check_kv_bytes_per_token, lambda cfg, size: math.floor(cfg.n_layers * kv_elements(cfg) * size)),
    "kv ceil": (checks.check_kv_bytes_per_token, lambda cfg, size: math.ceil(cfg.n_layers * kv_elements(cfg) * size)),
    "weights floor": (checks.check_weight_bytes, lambda cfg, size: math.floor(params(cfg) * size)),
    "weights ceil": (checks.check_weight_bytes, lambda cfg, size: math.ceil(params(cfg) * size)),
}


@pytest.mark.parametrize(("check", "wrong"), ROUNDING_SLIPS.values(), ids=ROUNDING_SLIPS)
def test_kv_and_weights_reject_any_int_but_the_nearest(check, wrong):
    assert "nearest integer" in assert_fails(check, wrong, match="bytes_per_element=0.5625")
    assert_fails(getattr(hidden, check.__name__), wrong, match="hidden-odd")


def test_kv_and_weights_right_answers_pass_hidden_cases():
    hidden.check_kv_bytes_per_token(kv_bytes)
    hidden.check_weight_bytes(weight_bytes)


# -- hints fire only where their cause fits --------------------------------------------------------------------
def query_heads(cfg, size):
    return round(cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * size)


def test_query_heads_named_not_bits_when_the_ratio_is_not_eight():
    cfg = get_model("llama-3.1-8b").replace(n_kv_heads=2, name="gqa-16")  # 32 heads / 2: a factor 16
    message = assert_fails(checks.check_kv_bytes_per_token, query_heads, cases=[(cfg, 2)], match="gqa-16")
    assert "query heads (n_heads)" in message and "bits" not in message


def test_query_heads_named_alone_where_bits_give_the_same_value():
    message = assert_fails(checks.check_kv_bytes_per_token, query_heads, match="llama-3.1-70b")  # 64 / 8 heads: also 8x
    assert "query heads" in message and "bits" not in message  # the likeliest cause alone, no red herring


def test_bits_named_on_a_model_without_grouped_heads():
    def bits(cfg, size):
        return kv_bytes(cfg, size * 8)

    message = assert_fails(
        checks.check_kv_bytes_per_token, bits, cases=[(get_model("llama-2-7b"), 2)], match="llama-2-7b"
    )
    assert "bits per element" in message and "query heads" not in message


def test_weights_with_query_heads_for_kv_named():
    def wrong(cfg, size):
        return weight_bytes(cfg.replace(n_kv_heads=cfg.n_heads), size)

    assert "n_kv_heads x head_dim" in assert_fails(checks.check_weight_bytes, wrong, match="llama-3.1-70b")


def test_copy_time_in_ms_blames_the_time_not_the_bandwidth_unit():
    message = assert_fails(checks.check_copy_gbps, lambda n, ms: 2 * n / (ms * 1e3) / 1e9, match="copy_gbps")
    assert "1/1000" in message and "times in ms" in message and "GB vs MB" not in message


def test_stream_time_in_seconds_is_named():
    message = assert_fails(checks.check_stream_ms, lambda n, gbps: n / (gbps * 1e9), match="stream_ms")
    assert "in seconds? Return milliseconds" in message


def test_copy_counted_once_is_named():
    assert "also writes" in assert_fails(checks.check_copy_gbps, lambda n, s: n / s / 1e9, match="copy_gbps")


def test_tpot_without_batch_is_named():
    message = assert_fails(checks.check_tpot_ms, lambda w, kv, t, b, gbps: (w + t * kv) / gbps / 1e6, match="batch=26")
    assert "leaves out the batch" in message


def test_hidden_failure_names_a_wrong_value_not_the_type_returned():
    message = assert_fails(hidden.check_kv_bytes_per_token, lambda cfg, size: kv_bytes(cfg, size) + 1, match="hidden")
    assert "not the right number of bytes" in message and not re.search(r"\bint\b", message)


def test_non_finite_answer_is_told_so():
    message = assert_fails(checks.check_stream_ms, lambda n, gbps: math.nan, match="finite")
    assert "division by zero" in message and "Return a float" not in message


def test_helpers_keep_ratio_hints_out_of_hidden_messages():
    assert grading.hint(2.0, 1.0, reveal=False, unit="ms", slips=((2.0, "named"),)) == ""
    assert grading.hint(3.0, 1.0, reveal=True, unit="ms") == ""


# -- the error audit: a function, re-run on models the lesson does not show --------------------------------------
def test_error_audit_right_answer_passes_public_and_hidden():
    checks.check_error_audit(audit, EXPRESSION)
    hidden.check_error_audit(audit)


def test_error_audit_pasted_numbers_fail_the_hidden_check():
    public = {(cfg.name, context): audit(cfg, context) for cfg, context in lesson01_bytes_per_step._audit_models()}

    def pasted(cfg, context):
        return public.get((cfg.name, context), public["llama-3.1-70b", 32_768])

    checks.check_error_audit(pasted, EXPRESSION)  # the public cases cannot tell
    message = assert_fails(hidden.check_error_audit, pasted, match="hidden-gqa")
    assert str(audit(hidden._GQA, 12_345)["mha_kv_bytes"]) not in message


@pytest.mark.parametrize(
    ("expression", "match"),
    [(83_900_000_000, "claim's 83.9 GB"), (EXPRESSION * 1000, "MB, not GB")],
)
def test_error_audit_circulating_figures_named(expression, match):
    assert_fails(checks.check_error_audit, audit, expression, match=match)


def test_error_audit_mha_cache_for_the_real_model_named():
    def mha_twice(cfg, context):
        out = audit(cfg, context)
        return {**out, "kv_bytes": out["mha_kv_bytes"]}

    assert_fails(checks.check_error_audit, mha_twice, match="kv_bytes.*MHA cache")


def test_error_audit_inverted_ratio_named():
    def inverted(cfg, context):
        out = audit(cfg, context)
        return {**out, "kv_over_weights": 1 / out["kv_over_weights"]}

    assert_fails(checks.check_error_audit, inverted, match="weights / KV")


# -- the measured copy: the band, with kvlab's measurement replaced by a fixed one ---------------------------------
N_BYTES = 10**9  # above any floor: bandwidth_buffer_mb is replaced below


@pytest.fixture
def kvlab_copy_10gbps(monkeypatch):
    bw = Bandwidth("cpu", N_BYTES / 1e6, copy_gbps=10.0, read_gbps=10.0, copy_best_gbps=10.0, read_best_gbps=10.0)
    monkeypatch.setattr(lesson00_orientation, "measure_bandwidth", lambda *args, **kwargs: bw)
    monkeypatch.setattr(lesson00_orientation, "bandwidth_buffer_mb", lambda quick: 500.0)


def timings_at(gbps: float, n: int = 10) -> list[float]:
    return [2 * N_BYTES / (gbps * 1e9)] * n


@pytest.mark.parametrize("gbps", [10.0 / 2.4, 10.0 * 2.4])
def test_measured_copy_inside_the_band_passes(kvlab_copy_10gbps, gbps):
    checks.check_measured_copy(gbps, timings_at(gbps), N_BYTES)


@pytest.mark.parametrize("gbps", [10.0 / 2.6, 10.0 * 2.6, 10.0 / 1e3])
def test_measured_copy_outside_the_band_fails(kvlab_copy_10gbps, gbps):
    assert_fails(checks.check_measured_copy, gbps, timings_at(gbps), N_BYTES, match="within 2.5x")


def test_measured_copy_cumulative_timings_fail(kvlab_copy_10gbps):
    per_copy = timings_at(10.0, 1)[0]
    cumulative = [per_copy * (i + 1) for i in range(5)]  # one clock started before the loop: median 3 copies
    gbps = 2 * N_BYTES / (3 * per_copy) / 1e9
    assert_fails(checks.check_measured_copy, gbps, cumulative, N_BYTES, match="restart the clock")


def test_measured_copy_buffer_in_cache_fails(kvlab_copy_10gbps):
    assert_fails(checks.check_measured_copy, 10.0, timings_at(10.0), 100 * 10**6, match="last-level cache")


def test_measured_copy_fastest_timing_named(kvlab_copy_10gbps):
    times = timings_at(10.0, 9) + [timings_at(20.0, 1)[0]]
    assert_fails(checks.check_measured_copy, 20.0, times, N_BYTES, match="fastest timing")


def test_error_audit_says_which_exercises_it_builds_on():
    def audit_without_k_and_v(cfg, context):
        out = audit(cfg, context)
        return {**out, "kv_bytes": out["kv_bytes"] // 2}

    assert_fails(checks.check_error_audit, audit_without_k_and_v, match="exercises 1 and 2")


def test_error_audit_hidden_cases_leave_exercise_one_slips_to_exercise_one():
    def derived_head_dim(cfg, size):  # right on every model whose head_dim is d_model / n_heads
        return round(2 * cfg.n_layers * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * size)

    def audit_on(kv):
        def run(cfg, context):
            own = kv(cfg, 2) * context
            mha = kv(cfg.replace(n_kv_heads=cfg.n_heads), 2) * context
            return {"mha_kv_bytes": mha, "kv_bytes": own, "kv_over_weights": own / weight_bytes(cfg, 2)}

        return run

    assert_fails(hidden.check_kv_bytes_per_token, derived_head_dim, match="hidden-mqa")
    hidden.check_error_audit(audit_on(derived_head_dim))


def test_measured_copy_timings_in_ms_named(kvlab_copy_10gbps):
    # The bandwidth is right (10 GB/s); the timings handed in are in ms, so they give 1/1000 of it.
    times_ms = [t * 1e3 for t in timings_at(10.0)]
    message = assert_fails(checks.check_measured_copy, 10.0, times_ms, N_BYTES, match="my_copy_gbps")
    assert "times_s in seconds" in message


def test_measured_copy_measures_kvlab_again_before_failing(monkeypatch):
    # The first reference met a burst of load (3 GB/s); the next one is the machine's 10 GB/s.
    refs = iter([3.0, 10.0])
    monkeypatch.setattr(lesson00_orientation, "bandwidth_buffer_mb", lambda quick: 500.0)
    monkeypatch.setattr(
        lesson00_orientation,
        "measure_bandwidth",
        lambda *a, **k: Bandwidth("cpu", N_BYTES / 1e6, next(refs), 10.0, 10.0, 10.0),
    )
    checks.check_measured_copy(10.0, timings_at(10.0), N_BYTES)


def test_measured_copy_fails_when_every_reference_disagrees(kvlab_copy_10gbps):
    assert_fails(checks.check_measured_copy, 30.0, timings_at(30.0), N_BYTES, match="within 2.5x")


def test_cumulative_timings_are_told_apart_from_steady_ones():
    assert lesson00_orientation._cumulative([0.01, 0.02, 0.03, 0.04, 0.05])
    assert lesson00_orientation._cumulative([0.01, 0.021, 0.029, 0.041, 0.05])  # one clock, a little noise
    assert not lesson00_orientation._cumulative([0.01, 0.011, 0.0095, 0.012, 0.01])
    assert not lesson00_orientation._cumulative([0.01, 0.02, 0.02, 0.02, 0.02])  # one slow copy among steady ones
