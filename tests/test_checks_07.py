"""Lesson 07's checkers (sliding window + sinks): a right answer passes silently, a likely wrong one fails with a
message that names the fix, hidden checks withhold the expected value, and the measured checks are tested on
fabricated sweeps and results (the remeasure replaced), so nothing here is timed or runs a model."""

from __future__ import annotations

import math

import pytest

from autograde import hidden
from kvlab import checks, roofline
from kvlab.machine.timing import Bandwidth
from kvlab.measure.quality import NeedleResult, PerplexityResult, needle_prompts
from kvlab.measure.sweep import Sweep
from tests import helpers
from tests.helpers import assert_fails, assert_silent

BW = helpers.BW


# -- reference answers, written the way a learner would -------------------------------------------------------------
def kept_positions(n_seen, window, sinks):
    if n_seen <= sinks + window:
        return list(range(n_seen))
    return list(range(sinks)) + list(range(n_seen - window, n_seen))


def reassigned_positions(n_seen, window, sinks):
    n = min(n_seen, sinks + window)
    return list(range(n)), n - 1


def window_bytes_read(cfg, context, window, sinks, kv_dtype):
    return roofline.kv_bytes_per_token(cfg, kv_dtype) * min(context, window + sinks)


def passkey_kept(context, depth, window, sinks):
    return round(depth * (context - 2)) in kept_positions(context, window, sinks)


def largest_distance(n_seen, window, sinks, positions):
    if positions == "reassigned":
        return min(n_seen, window + sinks) - 1
    return n_seen - 1 - kept_positions(n_seen, window, sinks)[0]


FUNCTIONS = [
    (checks.check_kept_positions, hidden.check_kept_positions, kept_positions),
    (checks.check_reassigned_positions, hidden.check_reassigned_positions, reassigned_positions),
    (checks.check_window_bytes_read, hidden.check_window_bytes_read, window_bytes_read),
    (checks.check_passkey_kept, hidden.check_passkey_kept, passkey_kept),
    (checks.check_largest_distance, hidden.check_largest_distance, largest_distance),
]


@pytest.mark.parametrize(("public", "secret", "fn"), FUNCTIONS, ids=lambda x: getattr(x, "__name__", ""))
def test_right_answers_pass_silently(capsys, public, secret, fn):
    assert_silent(capsys, public, fn)
    assert_silent(capsys, secret, fn)


# -- exercise 1 ----------------------------------------------------------------------------------------------------
def test_kept_positions_slips():
    assert_fails(
        checks.check_kept_positions,
        lambda n, w, s: list(range(s)) + list(range(n - w + 1, n + 1)) if n > s + w else list(range(n)),
        match="not seen yet",
    )
    assert_fails(
        checks.check_kept_positions,
        lambda n, w, s: list(range(n - w - s, n)) if n > s + w else list(range(n)),
        match="sinks",
    )
    assert_fails(
        checks.check_kept_positions, lambda n, w, s: list(range(s)) + list(range(max(0, n - w), n)), match="once"
    )
    assert_fails(checks.check_kept_positions, lambda n, w, s: "0..n", match="list of ints")


def test_kept_positions_listing_sinks_not_seen_yet_fails():
    """The learner review's accepted slip: no "not yet full" branch lists [0, 1, 2, 3] for n_seen=2, sinks=4."""

    def no_first_branch(n_seen, window, sinks):
        return list(range(sinks)) + list(range(max(sinks, n_seen - window), n_seen))

    message = assert_fails(checks.check_kept_positions, no_first_branch, match="not seen yet")
    assert "A sink is held once it has been seen" in message


def test_kept_positions_hidden_withholds():
    message = assert_fails(
        hidden.check_kept_positions, lambda n, w, s: list(range(s)) + list(range(n - w, n)), match="hidden"
    )
    assert "expected" not in message


# -- exercise 2 ----------------------------------------------------------------------------------------------------
def test_reassigned_positions_slips():
    original = lambda n, w, s: (kept_positions(n, w, s), n - 1)  # noqa: E731
    assert_fails(checks.check_reassigned_positions, original, match="original positions' distances")
    one_past = lambda n, w, s: (reassigned_positions(n, w, s)[0], len(reassigned_positions(n, w, s)[0]))  # noqa: E731
    assert_fails(checks.check_reassigned_positions, one_past, match="one too large")
    assert_fails(checks.check_reassigned_positions, lambda n, w, s: ([0], 0), match="length")


def test_reassigned_positions_accepts_any_numbering_with_the_right_distances(capsys):
    shifted = lambda n, w, s: ([p + 7 for p in reassigned_positions(n, w, s)[0]], reassigned_positions(n, w, s)[1] + 7)  # noqa: E731
    assert_silent(capsys, checks.check_reassigned_positions, shifted)


# -- exercise 3 ----------------------------------------------------------------------------------------------------
def test_window_bytes_read_slips():
    per_token = roofline.kv_bytes_per_token
    assert_fails(
        checks.check_window_bytes_read, lambda c, n, w, s, d: per_token(c, d) * min(n, w), match="leaves out the sinks"
    )
    assert_fails(
        checks.check_window_bytes_read, lambda c, n, w, s, d: per_token(c, d) * (w + s), match="shorter than that"
    )
    assert_fails(checks.check_window_bytes_read, lambda c, n, w, s, d: per_token(c, d) * n, match="whole context")
    assert_fails(checks.check_window_bytes_read, lambda c, n, w, s, d: 1.5, match="an int")
    # The second playtest's accepted slip: the model's dtype in place of kv_dtype.
    assert_fails(
        checks.check_window_bytes_read, lambda c, n, w, s, d: per_token(c) * min(n, w + s), match="model's dtype"
    )


def test_window_bytes_read_hidden_head_dim():
    derived = lambda c, n, w, s, d: (  # noqa: E731
        2 * c.n_layers * c.n_kv_heads * (c.d_model // c.n_heads) * roofline.kv_element_bytes(d) * min(n, w + s)
    )
    message = assert_fails(hidden.check_window_bytes_read, derived, match="hidden")
    assert "expected" not in message


# -- exercise 5 ----------------------------------------------------------------------------------------------------
def test_passkey_kept_slips():
    before_question = lambda c, d, w, s: round(d * (c - 2)) in kept_positions(c - 1, w, s)  # noqa: E731
    assert_fails(hidden.check_passkey_kept, before_question, match="hidden")
    no_sinks = lambda c, d, w, s: passkey_kept(c, d, w, 0)  # noqa: E731
    assert_fails(checks.check_passkey_kept, no_sinks, match="kept_positions")
    assert_fails(checks.check_passkey_kept, lambda c, d, w, s: "yes", match="bool")


def test_passkey_kept_truncating_the_position_fails():
    """The learner review's accepted slip: int() where the text and needle_prompts round()."""
    truncated = lambda c, d, w, s: int(d * (c - 2)) in kept_positions(c, w, s)  # noqa: E731
    assert_fails(checks.check_passkey_kept, truncated, match=r"round\(\)")
    rounded_up = lambda c, d, w, s: math.ceil(d * (c - 2)) in kept_positions(c, w, s)  # noqa: E731
    assert_fails(checks.check_passkey_kept, rounded_up, match="rounded up")


# -- exercise 7 ----------------------------------------------------------------------------------------------------
def test_largest_distance_slips():
    assert_fails(checks.check_largest_distance, lambda n, w, s, p: min(n, w) - 1, match="sink")
    assert_fails(checks.check_largest_distance, lambda n, w, s, p: n - 1, match="re-assigned")
    # The second playtest's accepted slip: re-assigned, as if the cache were always full.
    full = lambda n, w, s, p: n - 1 - kept_positions(n, w, s)[0] if p == "original" else s + w - 1  # noqa: E731
    assert_fails(checks.check_largest_distance, full, match="until it fills")


# -- exercise 4, measured ----------------------------------------------------------------------------------------------
def fake_sweep(slope_us: float, flat: bool, bandwidth: Bandwidth = BW) -> Sweep:
    """A window's sweep reads the same bytes at every context (``flat``), the full cache's grow with it."""
    return helpers.fake_sweep(
        slope_us,
        64.0,
        bandwidth,
        contexts=(1024, 2048, 4096, 8192),
        step_bytes=lambda context: 1000 + (1024 if flat else context) * 64,
        weight_bytes=1000,
    )


def test_window_share_passes_and_checks_consistency(capsys):
    full, window = fake_sweep(1.0, False), fake_sweep(0.05, True)
    assert_silent(capsys, checks.check_window_share, 0.05, full, window)
    assert_fails(checks.check_window_share, 20.0, full, window, match="inverted")
    assert_fails(checks.check_window_share, 0.05, window, full, match="same bytes")


def not_seen_note(capsys) -> str:
    out, err = capsys.readouterr()
    assert err == "" and "did not show" in out and "grade does not depend on it" in out, (out, err)
    return out


@pytest.mark.parametrize(
    ("full_slope", "window_slope", "unmet"),
    [
        (1.0, 0.9, "not flat: 0.90"),  # the window climbed nearly as the full cache did
        (1.0, -0.8, "not flat: -0.80"),  # the window fell steeply: tilted by load, not flat either
        (-0.2, 0.05, "did not climb"),  # the full cache's line fell: nothing to compare with
    ],
    ids=["window_climbs", "window_falls", "full_falls"],
)
def test_window_runs_that_contradict_the_lesson_pass_on_arithmetic_and_say_not_seen(
    capsys, full_slope, window_slope, unmet
):
    full, window = fake_sweep(full_slope, False), fake_sweep(window_slope, True)
    checks.check_window_share(window.fit.slope / full.fit.slope, full, window)
    assert unmet in not_seen_note(capsys)
    assert not checks.window_reading(full, window).seen


def test_window_share_needs_one_bandwidth():
    other = Bandwidth("cpu", 64.0, copy_gbps=10.0, read_gbps=10.0, copy_best_gbps=11.0, read_best_gbps=11.0, threads=1)
    assert_fails(
        checks.check_window_share, 0.05, fake_sweep(1.0, False), fake_sweep(0.05, True, other), match="Bandwidth"
    )


# -- exercise 5, measured ----------------------------------------------------------------------------------------------
def needle(context: int, depth: float, accuracy: float) -> NeedleResult:
    position = needle_prompts(context, depth, 1, [1, 2, 3])[2]
    n = 8
    return NeedleResult(context, depth, position, context - 1 - position, n, round(accuracy * n), accuracy, 0.5, (), ())


DEPTHS = (0.0, 0.6, 0.97)


def recall_table(kept_acc: float = 1.0, gone_acc: float = 0.125):
    policies = ((32, 0), (32, 4), (128, 0))
    recall = {
        (w, s): [needle(256, d, kept_acc if passkey_kept(256, d, w, s) else gone_acc) for d in DEPTHS]
        for w, s in policies
    }
    kept = {(w, s, d): passkey_kept(256, d, w, s) for w, s in policies for d in DEPTHS}
    return recall, kept


def test_recall_kept(capsys):
    recall, kept = recall_table()
    assert_silent(capsys, checks.check_recall_kept, recall, kept)
    wrong = dict(kept)
    wrong[(32, 4, 0.0)] = False
    assert_fails(checks.check_recall_kept, recall, wrong, match="position 0")
    assert_fails(checks.check_recall_kept, *recall_table(kept_acc=0.25), match="kept")
    assert_fails(checks.check_recall_kept, *recall_table(gone_acc=0.75), match="evicted")
    missing = dict(kept)
    del missing[(128, 0, 0.6)]
    assert_fails(checks.check_recall_kept, recall, missing, match="every")


# -- exercise 6 ----------------------------------------------------------------------------------------------------
def ppl_result(value: float) -> PerplexityResult:
    import math

    return PerplexityResult(1024, 992, 1, 32, math.log(value), value, ())


def test_sink_gain(capsys):
    table = {
        "a": {
            (None, 0, "original"): ppl_result(9.0),
            (32, 0, "original"): ppl_result(4.0),
            (32, 4, "original"): ppl_result(5.0),
            (32, 4, "reassigned"): ppl_result(3.9),
        }
    }
    right = {"a": {32: {"original": 4.0 / 5.0, "reassigned": 4.0 / 3.9}}}
    assert_silent(capsys, checks.check_sink_gain, right, table)
    inverted = {"a": {32: {"original": 5.0 / 4.0, "reassigned": 3.9 / 4.0}}}
    assert_fails(checks.check_sink_gain, inverted, table, match="inverted")
    assert_fails(checks.check_sink_gain, {"a": {32: {"original": 0.8}}}, table, match="missing")
    assert_fails(checks.check_sink_gain, {}, table, match="checkpoint")
