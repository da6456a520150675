"""Lesson 08's checkers (heavy hitters and session caps): a right answer passes silently, a likely wrong one fails
with a message that names the fix, hidden checks withhold the expected value, and the checks on measured data run on
a tiny random model's scores and on made-up chats, so nothing here is timed."""

from __future__ import annotations

import math

import pytest
import torch

from autograde import hidden
from kvlab import Decoder, checks
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.course import lesson08_heavy_hitters as lesson08
from kvlab.roofline import kv_element_bytes
from tests.helpers import assert_fails, assert_silent, tiny_config


# -- reference answers, written the way a learner would -------------------------------------------------------------
def h2o_keep(scores, positions, newest, heavy, recent):
    recent_kept = [p for p in positions if p > newest - recent]
    older = sorted(((s, p) for s, p in zip(scores, positions, strict=True) if p <= newest - recent), reverse=True)
    return sorted(recent_kept + [p for _, p in older[:heavy]])


def h2o_bytes_per_step(cfg, context, heavy, recent, batch):
    kept = min(context, heavy + recent)
    rows = batch * cfg.n_layers * cfg.n_kv_heads
    kv = rows * kept * 2 * cfg.head_dim * kv_element_bytes(cfg.dtype)
    evict = (heavy + recent) * 12 if context > heavy + recent else 0
    return round(kv + rows * (4 * kept + evict))


def passkey_rank(scores, positions, position):
    return 1 + int((scores > scores[positions == position]).sum())


def break_even_steps(rebuild, gbps):
    saved = rebuild.kv_bytes_saved_per_step / (gbps * 1e9)
    return math.inf if saved <= 0 else rebuild.seconds / saved


def chat_time(turns):
    reprefill = sum(t["reprefill_ms"] for t in turns)
    return reprefill + sum(t["prefill_ms"] + sum(t["decode_ms"]) for t in turns), reprefill


@pytest.fixture(scope="module")
def score_cache() -> HeavyHitterKVCache:
    """A no-eviction H2O cache after a 40-token prompt through a tiny random model: 2 sequences, 2 KV heads."""
    model = Decoder(tiny_config(), seed=0)
    cache = HeavyHitterKVCache.for_model(model, 2, 64, heavy=63, recent=1)
    model.prefill(torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(0)), cache)
    return cache


MEASURED = {"uncapped": lesson08.made_up_turns(4, seed=5, rebuild_every=9), "capped": lesson08.made_up_turns(4, 6, 1)}

FUNCTIONS = [
    (checks.check_h2o_keep, hidden.check_h2o_keep, h2o_keep),
    (checks.check_h2o_bytes_per_step, hidden.check_h2o_bytes_per_step, h2o_bytes_per_step),
    (checks.check_passkey_rank, hidden.check_passkey_rank, passkey_rank),
    (checks.check_break_even_steps, hidden.check_break_even_steps, break_even_steps),
    (checks.check_chat_time, hidden.check_chat_time, chat_time),
]


# -- right answers pass silently -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("public", "secret", "fn"), FUNCTIONS, ids=lambda x: getattr(x, "__name__", ""))
def test_right_answers_pass_silently(capsys, public, secret, fn):
    assert_silent(capsys, public, fn)
    assert_silent(capsys, secret, fn)


def test_measured_data_pass_silently(capsys, score_cache):
    assert_silent(capsys, checks.check_passkey_rank, passkey_rank, score_cache, 17)
    assert_silent(capsys, checks.check_chat_time, chat_time, MEASURED)


def test_keep_accepts_any_tied_choice():
    # Two old tokens tie for the last heavy slot: either may stay.
    scores, positions = [1.0, 3.0, 1.0, 0.5, 9.0], [0, 1, 2, 3, 4]
    for kept in ([1, 0, 4], [1, 2, 4]):
        checks.check_h2o_keep(lambda *args, kept=kept: kept, cases=[(scores, positions, 4, 2, 1)])
    assert_fails(checks.check_h2o_keep, lambda *args: [1, 3, 4], cases=[(scores, positions, 4, 2, 1)], match="h2o")


# -- wrong answers fail, naming the fix ------------------------------------------------------------------------------
def top_scores_only(scores, positions, newest, heavy, recent):
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [positions[i] for i in order[: heavy + recent]]


def recent_off_by_one(scores, positions, newest, heavy, recent):
    return h2o_keep(scores, positions, newest, heavy, recent - 1)


def slot_indices(scores, positions, newest, heavy, recent):
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[: min(len(scores), heavy + recent)]


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (top_scores_only, "top scores only"),
        (recent_off_by_one, "Off by one"),
        (slot_indices, "slot indices"),
        (lambda s, p, n, h, r: h2o_keep(s, p, n, h, r)[1:], "It keeps"),
        (lambda *args: "0, 1", "collection of ints"),
        (lambda *args: (_ for _ in ()).throw(NotImplementedError), "not implemented yet"),
    ],
)
def test_keep_slips(fn, match):
    assert_fails(checks.check_h2o_keep, fn, match=match)


def test_hidden_keep_withholds_the_answer():
    message = assert_fails(hidden.check_h2o_keep, top_scores_only, match="hidden check does not reveal")
    assert "expected [" not in message


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda cfg, c, h, r, b: h2o_bytes_per_step(cfg, min(c, h + r), h, r, b) - 0, "leaves out the eviction"),
        (
            lambda cfg, c, h, r, b: b * cfg.n_layers * cfg.n_kv_heads * min(c, h + r) * 2 * cfg.head_dim * 4,
            "K/V alone",
        ),
        (lambda cfg, c, h, r, b: h2o_bytes_per_step(cfg, c, h, r, b) * cfg.n_heads // cfg.n_kv_heads, "n_heads"),
        (lambda cfg, c, h, r, b: float(h2o_bytes_per_step(cfg, c, h, r, b)), "an int"),
    ],
)
def test_bytes_slips(fn, match):
    assert_fails(checks.check_h2o_bytes_per_step, fn, match=match)


def h2o_bytes_evicting_at_the_budget(cfg, context, heavy, recent, batch):
    """The playtest's accepted slip: the eviction's read charged from context == heavy + recent (>= for >)."""
    full = h2o_bytes_per_step(cfg, context, heavy, recent, batch)
    at_budget = context == heavy + recent
    return full + (batch * cfg.n_layers * cfg.n_kv_heads * (heavy + recent) * 12 if at_budget else 0)


def test_bytes_refuses_evicting_at_the_budget():
    assert_fails(checks.check_h2o_bytes_per_step, h2o_bytes_evicting_at_the_budget, match="passes the budget")
    assert_fails(hidden.check_h2o_bytes_per_step, h2o_bytes_evicting_at_the_budget, match="hidden")


def test_hidden_bytes_withholds_the_answer():
    message = assert_fails(hidden.check_h2o_bytes_per_step, lambda *a: h2o_bytes_per_step(*a) + 1, match="hidden")
    assert "expected" not in message


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda s, p, q: passkey_rank(s, p, q) - 1, "1 \\+ that"),
        (lambda s, p, q: 1 + int((s < s[p == q]).sum()), "from the bottom"),
        (lambda s, p, q: 1 + int((s > s[q]).sum()), "positions == position"),
        (lambda s, p, q: float(passkey_rank(s, p, q)), "an int"),
    ],
)
def test_rank_slips(fn, match):
    assert_fails(checks.check_passkey_rank, fn, match=match)


def test_rank_on_measured_data_names_the_row(score_cache):
    assert_fails(checks.check_passkey_rank, lambda s, p, q: passkey_rank(s, p, q) + 2, score_cache, 17, match="layer 0")


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (
            lambda r, g: (r.kv_bytes_saved_per_step / (g * 1e9)) / r.seconds if r.kv_bytes_saved_per_step else math.inf,
            "inverted",
        ),
        (lambda r, g: break_even_steps(r, g) * 1e3, "in ms"),
        (
            lambda r, g: r.seconds / (r.kv_bytes_saved_per_step / (g * 1e9)) if r.kv_bytes_saved_per_step else 0.0,
            "math.inf",
        ),
    ],
)
def test_break_even_slips(fn, match):
    assert_fails(checks.check_break_even_steps, fn, match=match)


def test_chat_time_slips():
    no_reprefill = lambda turns: (chat_time(turns)[0] - chat_time(turns)[1], chat_time(turns)[1])  # noqa: E731
    assert_fails(checks.check_chat_time, no_reprefill, MEASURED, match="leaves out the re-prefills")
    assert_fails(checks.check_chat_time, lambda turns: chat_time(turns)[0], match="a pair")
    message = assert_fails(hidden.check_chat_time, no_reprefill, match="hidden check does not reveal")
    assert "leaves out" not in message
