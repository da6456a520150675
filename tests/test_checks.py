"""The lessons' checkers, called through kvlab.checks as the notebooks call them: a right answer passes silently;
a wrong one raises AssertionError that says what to fix."""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import math
import warnings

import pytest
import torch

from kvlab import checks, get_model, roofline
from kvlab.cache import KVCache
from kvlab.kernels.reference import attend_slab
from kvlab.machine.timing import Bandwidth
from kvlab.measure.sweep import Sweep
from kvlab.metrics import RequestTiming, fit_line, percentile
from tests import helpers
from tests.conftest import LESSONS, REPO
from tests.helpers import assert_fails, assert_silent


# -- reference answers, written the way a learner would -----------------------------------------------------------
def kv_bytes(cfg, size):
    per_layer = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim if cfg.mla else 2 * cfg.n_kv_heads * cfg.head_dim
    return round(cfg.n_layers * per_layer * size)


def weight_bytes(cfg, size):
    d = cfg.d_model
    layer = 2 * d * cfg.n_heads * cfg.head_dim + 2 * d * cfg.n_kv_heads * cfg.head_dim + 3 * d * cfg.d_ff + 2 * d
    return round((cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * layer + d) * size)


def request_metrics(times):
    ms = [t * 1e3 for t in times]
    gaps = [b - a for a, b in itertools.pairwise(ms)]
    tpot = (ms[-1] - ms[0]) / (len(ms) - 1) if len(ms) > 1 else None  # one token: no gap to average
    return {"ttft_ms": ms[0], "tpot_ms": tpot, "itl_ms": gaps, "e2el_ms": ms[-1]}


def achieved_fraction(row):
    predicted_ms = (row.weight_bytes + row.batch * row.context * row.kv_bytes_per_token) / row.bandwidth_gbps / 1e6
    return predicted_ms / row.measured_tpot_ms


def fit_tpot(x, y):
    f = fit_line(x, y)
    return f.slope * 1e3, f.intercept


def fake_sweep(slope_ms: float, bandwidth: Bandwidth, kv_per_token: float = 8192.0) -> Sweep:
    """``tests.helpers.fake_sweep`` with the slope in ms per token, as lesson 03's exercises state it."""
    return helpers.fake_sweep(slope_ms * 1e3, kv_per_token, bandwidth)


BW = Bandwidth("cpu", 256.0, copy_gbps=10.0, read_gbps=10.0, copy_best_gbps=11.0, read_best_gbps=11.0)
PREDICTED_SLOPE_MS = 8192 / 10e9 * 1e3  # KV bytes per token / bandwidth, for the fake sweep


# -- right answers pass silently ------------------------------------------------------------------------------------
RIGHT_ANSWERS = [
    (checks.check_quick_mode, lambda env: env.get("KVLAB_QUICK", "0") not in ("", "0") or "NBGRADER_EXECUTION" in env),
    (checks.check_copy_gbps, lambda n, s: 2 * n / s / 1e9),
    (checks.check_stream_ms, lambda n, gbps: n / gbps / 1e6),
    (checks.check_kv_bytes_per_token, kv_bytes),
    (checks.check_weight_bytes, weight_bytes),
    (checks.check_tpot_ms, lambda w, kv, t, b, gbps: (w + b * t * kv) / (gbps * 1e9) * 1e3),
    (checks.check_batch_for_tpot, lambda ms, w, kv, t, gbps: (ms / 1e3 * gbps * 1e9 - w) / (t * kv)),
    (checks.check_decode_attention_flops, lambda layers, d, t: 4 * layers * d * t),
    (checks.check_ridge_intensity, lambda peak, gbps: peak / gbps / 1e9),
    (checks.check_decode_flops, roofline.decode_flops),
    (checks.check_prefill_flops, roofline.prefill_flops),
    (checks.check_roofline_time_ms, lambda f, n, peak, gbps: max(f / peak, n / gbps / 1e9) * 1e3),
    (checks.check_achieved_fraction, achieved_fraction),
    (checks.check_request_metrics, request_metrics),
    (checks.check_percentile, percentile),
    (checks.check_crossover_context, lambda w, kv, b: w / b / kv),
]


@pytest.mark.parametrize(("check", "answer"), RIGHT_ANSWERS, ids=[c.__name__ for c, _ in RIGHT_ANSWERS])
def test_right_answer_passes_silently(capsys, check, answer):
    assert_silent(capsys, check, answer)


def test_fit_and_slope_band_right_answer(capsys):
    sweep = fake_sweep(PREDICTED_SLOPE_MS * 1.5, BW)
    assert_silent(capsys, checks.check_fit_tpot, fit_tpot, sweep)
    measured_us = sweep.fit.slope * 1e3
    assert_silent(capsys, checks.check_slope_band, PREDICTED_SLOPE_MS * 1e3, measured_us, sweep)


def test_ab_right_answer(capsys):
    assert_silent(capsys, checks.check_ab_slopes, fake_sweep(1e-3, BW), fake_sweep(3e-3, BW))


def test_fixed_overhead_right_answer(capsys):
    predicted = roofline.predict_tpot_ms(300_000, 10.0)
    assert_silent(capsys, checks.check_fixed_overhead, 0.5 - predicted, 0.5, predicted, 300_000, 10.0)


def test_environment_report_right_answer(capsys):
    report = {"device": "cpu", "threads": torch.get_num_threads(), "copy_gbps": BW.copy_gbps}
    assert_silent(capsys, checks.check_environment_report, report, BW)


def test_concat_cache_accepts_a_cache_that_concatenates(capsys):
    assert_silent(capsys, checks.check_concat_cache, ConcatGrowingCache.for_model)


def test_concat_cache_that_writes_in_place_fails():
    # The preallocated cache decodes the same logits and stores the same tokens, but copies nothing: what section 5
    # times is the copy, so the check must see it without a timing.
    message = assert_fails(
        checks.check_concat_cache, lambda model, batch, capacity: model.new_cache(batch, capacity), match="in place"
    )
    assert "torch.cat" in message


# -- wrong answers fail with a message that names the quantity and the fix -----------------------------------------
def test_kv_bytes_missing_factor_two_names_quantity_and_hint():
    message = assert_fails(
        checks.check_kv_bytes_per_token, lambda cfg, size: kv_bytes(cfg, size) // 2, match="kv_bytes_per_token"
    )
    assert "llama-3.1-70b" in message and "327680" in message  # the public example shows its expected value
    assert "factor of 2" in message and "bytes" in message


def test_kv_bytes_float_is_rejected_with_the_form_expected():
    message = assert_fails(checks.check_kv_bytes_per_token, lambda cfg, size: float(kv_bytes(cfg, size)), match="int")
    assert "round()" in message


def test_kv_bytes_ignoring_mla_fails():
    def no_mla(cfg, size):
        return round(2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * size)

    assert_fails(checks.check_kv_bytes_per_token, no_mla, match="deepseek-v3.*MLA")


def test_hidden_style_failure_withholds_the_expected_value():
    cfg = get_model("cpu-small").replace(head_dim=96, name="fresh")
    expected = roofline.kv_bytes_per_token(cfg, "fp32")
    message = assert_fails(
        checks.check_kv_bytes_per_token,
        lambda c, size: round(2 * c.n_layers * c.n_kv_heads * (c.d_model // c.n_heads) * size),
        cases=[(cfg, 4)],
        reveal=False,
        match="fresh",
    )
    assert str(expected) not in message and f"{expected:,}" not in message
    # A ratio hint ("half the expected value") would give the withheld value away as surely.
    halved = assert_fails(
        checks.check_kv_bytes_per_token, lambda c, s: kv_bytes(c, s) // 2, cases=[(cfg, 4)], reveal=False, match="fresh"
    )
    assert "expected value" not in halved


def test_not_implemented_says_so():
    def stub(*args):
        raise NotImplementedError()

    assert_fails(checks.check_copy_gbps, stub, match="not implemented yet")


def test_exception_in_answer_is_reported_with_its_call():
    assert_fails(checks.check_weight_bytes, lambda cfg, size: cfg.no_such_field, match="AttributeError")


WRONG_ANSWERS = [
    (checks.check_quick_mode, lambda env: "KVLAB_QUICK" in env, "KVLAB_QUICK"),
    (checks.check_copy_gbps, lambda n, s: n / s / 1e9, "copy_gbps.*reads n bytes and writes"),
    (checks.check_stream_ms, lambda n, gbps: n / gbps / 1e9, "stream_ms.*1/1000 of the expected"),
    (checks.check_tpot_ms, lambda w, kv, t, b, gbps: (w + t * kv) / gbps / 1e6, "batch=26"),
    (checks.check_batch_for_tpot, lambda ms, w, kv, t, gbps: math.ceil(ms / 1e3 * gbps * 1e9 / t / kv), "batch"),
    (checks.check_decode_attention_flops, lambda layers, d, t: 2 * layers * t * t * d, "no context\\^2"),
    (checks.check_ridge_intensity, lambda peak, gbps: peak / gbps, "FLOP/byte"),
    (checks.check_decode_flops, lambda cfg, t, b: 2 * roofline.param_count(cfg) * b, "attention"),
    (checks.check_prefill_flops, lambda cfg, t: 2 * roofline.param_count(cfg) * t + 2 * t * t, "causal|attends"),
    (checks.check_roofline_time_ms, lambda f, n, peak, gbps: (f / peak + n / gbps / 1e9) * 1e3, "max"),
    (checks.check_percentile, lambda v, p: sorted(v)[round((len(v) - 1) * p / 100)], "interpolate"),
    (checks.check_crossover_context, lambda w, kv, b: w / kv, "batch"),
]


@pytest.mark.parametrize(("check", "wrong", "match"), WRONG_ANSWERS, ids=[c.__name__ for c, _, _ in WRONG_ANSWERS])
def test_wrong_answer_fails_with_a_fix(check, wrong, match):
    assert_fails(check, wrong, match=match)


def test_request_metrics_tpot_including_first_token_fails():
    def wrong(times):
        out = request_metrics(times)
        out["tpot_ms"] = times[-1] * 1e3 / len(times)
        return out

    assert_fails(checks.check_request_metrics, wrong, match="tpot_ms.*first token")


def test_fit_inconsistent_with_own_data_fails():
    sweep = fake_sweep(1e-3, BW)
    assert_fails(
        checks.check_fit_tpot, lambda x, y: (fit_tpot(x, y)[0] / 1e3, fit_tpot(x, y)[1]), sweep, match="µs per token"
    )


def test_slope_band_rejects_a_prediction_from_another_bandwidth():
    sweep = fake_sweep(PREDICTED_SLOPE_MS, BW)
    assert_fails(
        checks.check_slope_band, PREDICTED_SLOPE_MS * 2e3, sweep.fit.slope * 1e3, sweep, match="predicted_slope_us"
    )


def test_ab_needs_one_bandwidth_measurement():
    other = Bandwidth("cpu", 256.0, 10.0, 10.0, 11.0, 11.0)  # equal values, but a second measurement
    assert_fails(checks.check_ab_slopes, fake_sweep(1e-3, BW), fake_sweep(3e-3, other), match="one Bandwidth")


def test_ab_unreadable_timing_is_told_not_failed(capsys):
    # Under AB_MIN_RATIO but steeper: load blurred it, or the machine's copy is cheap; the grade does not rest on it.
    checks.check_ab_slopes(fake_sweep(1e-3, BW), fake_sweep(1.2e-3, BW))
    out, err = capsys.readouterr()
    assert err == "" and "did not show" in out and "does not depend on it" in out and "1.20x, under 1.5" in out


def test_ab_timing_that_contradicts_the_lesson_says_so(capsys):
    checks.check_ab_slopes(fake_sweep(1e-3, BW), fake_sweep(0.8e-3, BW))
    out, _ = capsys.readouterr()
    assert "the opposite of the lesson" in out and "does not depend on it" in out


def test_ab_without_exercise_6_names_it():
    # The lesson passes globals().get(...): None when the A/B cell never ran because exercise 6 is unanswered.
    assert_fails(checks.check_ab_slopes, fake_sweep(1e-3, BW), None, match="exercise 6")


def test_slope_band_predicts_from_read_bandwidth():
    # Copy and read differ here: a prediction from the copy figure is another bandwidth's prediction.
    bw = Bandwidth("cpu", 256.0, copy_gbps=20.0, read_gbps=10.0, copy_best_gbps=21.0, read_best_gbps=11.0)
    sweep = fake_sweep(PREDICTED_SLOPE_MS, bw)
    assert_fails(
        checks.check_slope_band, PREDICTED_SLOPE_MS * 1e3 / 2, sweep.fit.slope * 1e3, sweep, match="predicted_slope_us"
    )


@pytest.mark.parametrize("ratio", [checks.SLOPE_BAND[0] * 1.01, 1.0, checks.SLOPE_BAND[1] * 0.99])
def test_slope_band_accepts_its_own_range(capsys, ratio):
    sweep = fake_sweep(PREDICTED_SLOPE_MS * ratio, BW)
    assert_silent(capsys, checks.check_slope_band, PREDICTED_SLOPE_MS * 1e3, sweep.fit.slope * 1e3, sweep)


def test_request_metrics_one_token_has_no_tpot():
    def zero_tpot(times):
        return {**request_metrics(times), "tpot_ms": 0.0}

    assert_fails(checks.check_request_metrics, zero_tpot, cases=[(0.25,)], match="None")


def test_decode_flops_of_a_mixture_of_experts_counts_the_experts_a_token_uses():
    cfg = get_model("mixtral-8x7b")
    moe = cfg.moe
    # Hand count: every parameter, less the routed experts a token skips in each MoE layer.
    skipped = (moe.n_experts - moe.top_k) * (cfg.n_layers - moe.n_dense_layers) * 3 * cfg.d_model * moe.expert_d_ff
    assert roofline.decode_flops(cfg, 0, 3) == 3 * 2 * (roofline.param_count(cfg) - skipped)
    assert_fails(
        checks.check_decode_flops,
        lambda c, t, b: (
            roofline.decode_flops(c, t, b)
            if c.moe is None
            else b * (2 * roofline.param_count(c) + 4 * c.n_layers * c.n_heads * c.head_dim * t)
        ),
        match="mixtral",
    )


def test_achieved_fraction_without_the_kv_bytes_fails():
    def weights_only(row):
        return row.weight_bytes / row.bandwidth_gbps / 1e6 / row.measured_tpot_ms

    assert_fails(checks.check_achieved_fraction, weights_only, match="batch x context")


def test_fixed_overhead_below_half_fails():
    predicted = roofline.predict_tpot_ms(3_000_000, 10.0)
    assert_fails(checks.check_fixed_overhead, 0.4 - predicted, 0.4, predicted, 3_000_000, 10.0, match="at least half")


class WrappedCache:
    """The preallocated cache, with one method replaced by a subclass: a learner's cache with one mistake."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)


def test_concat_cache_that_drops_tokens_fails():
    class Forgetful(WrappedCache):
        """Stores nothing after the prefill."""

        def append(self, layer, k, v):
            if self._cache.length <= 5:
                self._cache.append(layer, k, v)

    message = assert_fails(
        checks.check_concat_cache, lambda m, b, c: Forgetful(m.new_cache(b, c)), match="keys after 6 steps"
    )
    assert "[B, Hkv, D, S]" in message  # names the stored layout


class UnwrittenGrowingCache(KVCache):
    """Lesson 03's growing cache with an append that forgets to store: it holds no token when the prompt attends."""

    def __init__(self, shape, batch_size=1, capacity=None):
        super().__init__(shape, batch_size, capacity)
        self._layer_token_bytes = shape.elements_per_token * shape.torch_dtype.itemsize
        self._k_t = [torch.empty(batch_size, shape.n_kv_heads, shape.head_dim, 0) for _ in range(shape.n_layers)]
        self._v = [torch.empty(batch_size, shape.n_kv_heads, 0, shape.head_dim) for _ in range(shape.n_layers)]
        self._length = self._start = 0

    @property
    def length(self):
        return self._length

    def reserve(self, n_new):
        self._start, self._length = self._length, self._length + n_new
        return self._start

    def append(self, layer, k, v):
        pass

    def attend(self, layer, q, layer_window=None, rotate=None):
        return attend_slab(q, self._k_t[layer], self._v[layer], self._start, layer_window)

    def read(self, layer):
        return self._k_t[layer].transpose(-1, -2), self._v[layer]

    def reset(self):
        self._length = self._start = 0


class ConcatGrowingCache(UnwrittenGrowingCache):
    """Lesson 03's exercise 6 answered: append concatenates, a new tensor each step."""

    def append(self, layer, k, v):
        self._k_t[layer] = torch.cat([self._k_t[layer], k.permute(0, 2, 3, 1)], dim=-1)
        self._v[layer] = torch.cat([self._v[layer], v.transpose(1, 2)], dim=-2)


def test_concat_cache_that_stores_nothing_is_named_at_the_prompt_not_deep_in_a_kernel():
    message = assert_fails(checks.check_concat_cache, UnwrittenGrowingCache.for_model, match="prefill with your cache")
    assert "after the stored ones" in message and "[B, Hkv, D, S]" in message
    assert "ZeroDivisionError" not in message  # what the kernel's block arithmetic raised before attend_slab checked


def test_concat_cache_that_stores_tokens_out_of_order_fails():
    # Decode attention sums over the stored tokens in any order, so a cache that prepends decodes the same logits;
    # the check must look at what the cache holds.
    class Reversed(WrappedCache):
        def read(self, layer):
            k, v = self._cache.read(layer)
            return k.flip(-2), v.flip(-2)

    message = assert_fails(checks.check_concat_cache, lambda m, b, c: Reversed(m.new_cache(b, c)), match="in the order")
    assert "after the stored ones" in message


def test_quick_mode_reads_the_environment(monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.setenv("KVLAB_QUICK", "0")
    assert not checks.quick_mode()
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    assert checks.quick_mode()


def test_setup_lesson_under_nbgrader(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    try:
        with warnings.catch_warnings():
            assert checks.setup_lesson() is True
            assert torch.get_num_threads() == 1
            with warnings.catch_warnings(record=True) as caught:
                warnings.warn("harmless", UserWarning, stacklevel=1)
            assert caught == []  # silenced: nbgrader would zero a test cell for it
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("omp", "quick", "threads"), [(None, "0", 1), ("2", "0", None), ("2", "1", 1)])
def test_setup_lesson_threads(monkeypatch, omp, quick, threads):
    """One thread unless OMP_NUM_THREADS asks for more outside quick mode."""
    before = torch.get_num_threads()
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.setenv("KVLAB_QUICK", quick)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    try:
        checks.setup_lesson()
        assert torch.get_num_threads() == (before if threads is None else threads)
    finally:
        torch.set_num_threads(before)


def test_percentile_of_unsorted_values_names_the_sort():
    # On [3, 1, 2] the unsorted middle value is half the sorted one: the sort is the cause, not a factor of 2.
    message = assert_fails(checks.check_percentile, lambda v, p: v[round((len(v) - 1) * p / 100)], match="percentile")
    assert "not sorted" in message and "factor of 2" not in message


def scattered_sweep(slope_ms: float) -> Sweep:
    """A sweep whose points scatter about a line of ``slope_ms`` (R² well under SLOPE_MIN_R2), as load makes them."""
    sweep = fake_sweep(slope_ms, BW)
    for point, bump in zip(sweep.points, (0.0, 3.0, -1.5, 0.0), strict=True):
        tpot = point.requests[0].tpot_ms + bump
        point.requests[0] = RequestTiming((tpot / 1e3, 2 * tpot / 1e3))
    return sweep


@pytest.mark.parametrize(
    ("sweep", "unmet"),
    [
        (scattered_sweep(PREDICTED_SLOPE_MS * 6), "not straight"),  # load scattered the line
        (fake_sweep(PREDICTED_SLOPE_MS * 3 / 0.45, BW), "outside"),  # straight, but 6.7x the prediction
        (fake_sweep(PREDICTED_SLOPE_MS * 0.2, BW), "outside"),  # faster than the bandwidth allows
    ],
    ids=["scattered", "steep", "too_fast"],
)
def test_slope_band_grades_the_arithmetic_and_says_when_the_sweep_did_not_show_the_bytes(capsys, sweep, unmet):
    checks.check_slope_band(PREDICTED_SLOPE_MS * 1e3, sweep.fit.slope * 1e3, sweep)
    out, err = capsys.readouterr()
    assert err == "" and "did not show" in out and "grade does not depend on it" in out and unmet in out
    assert not checks.slope_reading(sweep).seen
    assert_fails(checks.check_slope_band, PREDICTED_SLOPE_MS * 1e3, 2 * sweep.fit.slope * 1e3, sweep, match="fit")


def test_slope_band_is_silent_on_a_readable_sweep(capsys):
    sweep = fake_sweep(PREDICTED_SLOPE_MS * 1.5, BW)
    assert checks.slope_reading(sweep).seen
    assert_silent(capsys, checks.check_slope_band, PREDICTED_SLOPE_MS * 1e3, sweep.fit.slope * 1e3, sweep)


def test_ab_reading_sees_a_steeper_concatenating_cache():
    assert checks.ab_reading(fake_sweep(1e-3, BW), fake_sweep(3e-3, BW)).seen
    assert not checks.ab_reading(fake_sweep(1e-3, BW), fake_sweep(1.4e-3, BW)).seen


# -- the index the notebooks import ---------------------------------------------------------------------------------
# Lesson "NN_name" keeps its checkers in kvlab/course/lessonNN_name.py: a new lesson needs no edit here.
LESSON_MODULES = {name: importlib.import_module(f"kvlab.course.lesson{name}") for name in LESSONS}


def notebook_imports(name: str) -> set[str]:
    """The names lesson ``name``'s solution imports from kvlab.checks."""
    nb = json.loads((REPO / "solutions" / name / f"{name}.ipynb").read_text())
    names = set()
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "kvlab.checks" in source:
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and node.module == "kvlab.checks":
                    names.update(alias.name for alias in node.names)
    return names


def test_index_exports_every_lesson_checker_once():
    exported = [name for module in LESSON_MODULES.values() for name in module.__all__]
    assert len(exported) == len(set(exported))
    assert sorted(checks.__all__) == sorted([*exported, "quick_mode", "setup_lesson", "TAKES", "retake"])
    for module in LESSON_MODULES.values():
        assert all(getattr(checks, name) is getattr(module, name) for name in module.__all__)


@pytest.mark.parametrize("name", LESSONS)
def test_each_lesson_imports_its_own_module_checkers(name):
    imported = notebook_imports(name)
    assert "setup_lesson" in imported and imported <= set(checks.__all__)
    own = {n for n in LESSON_MODULES[name].__all__ if n.startswith("check_")}
    assert {n for n in imported if n.startswith("check_")} == own
