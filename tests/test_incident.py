"""The capstone's replay: the engine's closed loop, the model-free replay at scale, the pool, the cap, the passkeys,
the checks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autograde import hidden
from kvlab.course import lesson11_capstone_incident as lesson11
from kvlab.course.incident import (
    INCIDENT,
    SCALE,
    ChatTrace,
    ChatTurn,
    Fix,
    TraceSession,
    TraceShape,
    at_scale,
    chat_trace,
    pool_tokens,
    replay,
    with_passkeys,
)
from kvlab.engine import Engine, Request
from kvlab.measure.session import turns_to_drop
from kvlab.model.decoder import Decoder
from kvlab.model.pretrained import load_pretrained
from kvlab.model.tokenizer import ASK, PASSKEY_BASE
from kvlab.roofline import kv_bytes_per_token, weight_bytes
from kvlab.spec.presets import get_gpu, get_model
from tests.helpers import sharp_random_model

SHAPE = TraceShape(4, 3, 32, (20, 40), (3, 6), (0.0, 0.01), 100.0)


@pytest.fixture(scope="module")
def tiny() -> Decoder:
    return load_pretrained("kvlab-tiny-stdlib", device="cpu")


def test_follow_up_chat_equals_generating_each_turn_alone():
    """A closed loop: each next turn's prompt holds the reply the engine generated, and gets the tokens that
    generate() gives that prompt alone, prefix hits or not."""
    model = sharp_random_model(101)
    first, second = list(range(1, 21)), list(range(30, 37))

    def follow_up(index, output, finish_s):
        assert finish_s > 0 and len(output) == (5 if index == 0 else 4)
        return [Request((*first, *output, *second), 4, finish_s + 0.001)] if index == 0 else []

    for prefix_caching in (True, False):
        engine = Engine(model, n_blocks=32, block_size=4, prefix_caching=prefix_caching, clock="simulated",
                        bandwidth_gbps=10.0)  # fmt: skip
        report = engine.run([Request(first, 5)], follow_up)
        assert len(report.results) == 2
        reply = model.generate(torch.tensor(first), 5).tolist()
        assert report.results[0].output_ids == reply
        assert report.results[1].output_ids == model.generate(torch.tensor([*first, *reply, *second]), 4).tolist()
        assert (report.prefix_hit_tokens > 0) == prefix_caching


def test_follow_up_may_not_arrive_before_the_answer():
    engine = Engine(sharp_random_model(101), n_blocks=16, block_size=4, clock="simulated", bandwidth_gbps=10.0)
    with pytest.raises(ValueError, match="follow_up"):
        engine.run([Request([1, 2, 3], 2)], lambda i, out, t: [Request([1, 2, 3], 2, t / 2)] if i == 0 else [])


def test_cap_rule_drops_the_oldest_turns_only_as_needed():
    assert turns_to_drop(10, [5, 5, 5], 4, 30) == 0
    assert turns_to_drop(10, [5, 5, 5], 6, 30) == 1
    assert turns_to_drop(10, [5, 7, 5], 14, 30) == 2
    with pytest.raises(ValueError, match="cap"):
        turns_to_drop(10, [5], 25, 30)


def test_pool_tokens_is_memory_less_weights_over_kv_per_token():
    cfg, gpu = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    for kv_dtype in (None, "fp8", "int4"):
        free = 0.9 * gpu.memory_gb * 1e9 - weight_bytes(cfg)
        assert pool_tokens(cfg, gpu, kv_dtype) == math.floor(free / kv_bytes_per_token(cfg, kv_dtype))
    assert pool_tokens(cfg, gpu, "int4") > 3 * pool_tokens(cfg, gpu)
    with pytest.raises(ValueError, match="gpu"):
        pool_tokens(get_model("llama-3.1-70b"), "h100-sxm")
    with pytest.raises(ValueError, match="utilization"):
        pool_tokens(cfg, gpu, None, 1.5)


def test_trace_is_one_draw_per_seed_and_scales_every_length():
    a, b = chat_trace(SHAPE, 3), chat_trace(SHAPE, 3)
    assert a == b and a != chat_trace(SHAPE, 4)
    assert len(a.sessions) == 4 and all(len(s.turns) == 3 for s in a.sessions)
    big = TraceShape(2, 4, 3200, (1600, 3200), (160, 320), (1.0, 2.0), 1.0)
    small = chat_trace(big.scaled(SCALE), 0)
    assert len(small.system) == round(3200 / SCALE)
    assert all(round(1600 / SCALE) <= len(t.user) <= round(3200 / SCALE) for s in small.sessions for t in s.turns)
    assert all(t.think_s <= 2.0 / SCALE for s in small.sessions for t in s.turns)


def test_passkey_sits_horizon_tokens_before_the_question():
    trace, answers = with_passkeys(chat_trace(SHAPE, 0), 50, seed=0)
    for s, session in enumerate(trace.sessions):
        tokens = list(trace.system)
        for turn in session.turns:
            tokens += turn.user
            tokens += [0] * turn.reply_tokens
        question = len(tokens) - 1 - session.turns[-1].reply_tokens
        assert tokens[question] == ASK and session.turns[-1].reply_tokens == 1
        assert PASSKEY_BASE <= answers[s] < ASK
        assert question - tokens.index(answers[s]) == 50


def test_fix_refuses_bad_levers_naming_them():
    for kwargs, field in (
        ({"kv_dtype": "int3"}, "kv_dtype"),
        ({"window": 0}, "window"),
        ({"sinks": 4}, "sinks"),
        ({"session_cap": -5}, "session_cap"),
        ({"prefix_caching": "yes"}, "prefix_caching"),
    ):
        with pytest.raises(ValueError, match=field):
            Fix(**kwargs)
    assert Fix(window=4096, sinks=4, session_cap=16000).scaled(80, 8192) == Fix(window=51, sinks=4, session_cap=200)
    # About the horizon: wider than it at scale exactly when wider than its 102 tokens at 1/80.
    scaled = {w: Fix(window=w).scaled(80, 8192).window for w in (8112, 8113, 8192, 8193, 8272, 8273)}
    assert scaled == {8112: 101, 8113: 102, 8192: 102, 8193: 103, 8272: 103, 8273: 104}
    # A few sinks stay whole; thousands are a share of the chat, scaled like the window.
    assert [Fix(window=1024, sinks=s).scaled(80, 8192).sinks for s in (0, 2, 4, 80, 4096)] == [0, 2, 4, 4, 51]
    with pytest.raises(ValueError, match="session_cap"):
        replay(chat_trace(SHAPE, 0), Fix(session_cap=40), None, n_blocks=64)


def test_model_free_replay_runs_the_engines_bookkeeping():
    """With no model, the scheduler claims the blocks a model's run would: prefix hits, a cap's dropped turns, a
    deterministic clock."""
    trace = ChatTrace(
        tuple(range(64)),
        tuple(TraceSession(0.01 * s, tuple(ChatTurn(tuple(range(100 + s, 164 + s)), 8, 0.5) for _ in range(4)))
              for s in range(3)),
    )  # fmt: skip
    cfg = get_model("llama-3.1-8b")
    plain, cached = (at_scale(trace, Fix(prefix_caching=p), cfg, "h100-sxm") for p in (False, True))
    assert plain.report.prefix_hit_tokens == 0 < cached.report.prefix_hit_tokens
    assert [r.output_ids for r in plain.report.results] == [[0] * 8] * 12
    assert plain.report.metrics() == at_scale(trace, Fix(prefix_caching=False), cfg, "h100-sxm").report.metrics()
    capped = at_scale(trace, Fix(prefix_caching=True, session_cap=64 + 3 * 72), cfg, "h100-sxm")
    assert [t.dropped_turns for t in capped.turns if t.session == 0] == [0, 0, 0, 1]
    assert max(t.prompt_tokens for t in capped.turns) <= 64 + 3 * 72
    # contexts_at: every row decoding then, each at least its prompt
    t = cached.report.results[0].timing.token_times_s[2] + cached.turns[0].arrival_s
    assert cached.contexts_at(t) and min(cached.contexts_at(t)) >= 64 + 64


def test_public_checkers_accept_kvlab_and_refuse_slips():
    lesson11.check_pool_tokens(lambda c, g, d, u: pool_tokens(c, g, d, u))
    lesson11.check_step_terms(lesson11.step_terms)
    lesson11.check_grown_term(lesson11.grown_term)
    with pytest.raises(AssertionError, match="int"):
        lesson11.check_pool_tokens(lambda c, g, d, u: float(pool_tokens(c, g, d, u)))
    with pytest.raises(AssertionError, match="subtract weight_bytes"):
        lesson11.check_pool_tokens(lambda c, g, d, u: math.floor(u * g.memory_gb * 1e9 / kv_bytes_per_token(c, d)))
    with pytest.raises(AssertionError, match="different contexts"):
        lesson11.check_step_terms(lambda c, ctx, d, w, s: lesson11.step_terms(c, [max(ctx)] * len(ctx), d, w, s))
    with pytest.raises(AssertionError, match="ratio"):
        lesson11.check_grown_term(lambda e, late: max(((t, late[t] - e[t]) for t in e), key=lambda p: p[1]))
    with pytest.raises(AssertionError, match="not early by late"):
        lesson11.check_grown_term(lambda e, late: max(((t, e[t] / late[t]) for t in e), key=lambda p: p[1]))


def test_check_grown_term_refuses_the_largest_late_term():
    """The playtest's accepted slip: pick the term that is largest late, then return its ratio."""

    def largest_late(early, late):
        term = max(late, key=late.get)
        return term, late[term] / early[term]

    with pytest.raises(AssertionError, match="not the largest one late, nor the one that added the most bytes"):
        lesson11.check_grown_term(largest_late)
    with pytest.raises(AssertionError, match="hidden"):
        hidden.check_grown_term(largest_late)


def test_check_grown_term_refuses_the_largest_difference():
    """The second playtest's accepted slip: pick the term that added the most bytes, then return its ratio."""

    def largest_difference(early, late):
        term = max(late, key=lambda t: late[t] - early[t])
        return term, late[term] / early[term]

    with pytest.raises(AssertionError, match="nor the one that added the most bytes"):
        lesson11.check_grown_term(largest_difference)
    with pytest.raises(AssertionError, match="hidden"):
        hidden.check_grown_term(largest_difference)


@pytest.mark.slow
def test_check_fix_measures_both_halves(tiny):
    """The lesson's answer passes; the empty fix misses the SLOs; a window shorter than the horizon forgets."""
    lesson11.check_fix(Fix(prefix_caching=True, kv_dtype="int4"), tiny, seeds=(0,))
    with pytest.raises(AssertionError, match="P99 TPOT"):
        lesson11.check_fix(Fix(), tiny, seeds=(0,))  # the service before the incident
    with pytest.raises(AssertionError, match="P99 TTFT"):
        lesson11.check_fix(Fix(prefix_caching=False, kv_dtype="int4"), tiny, seeds=(0,))
    with pytest.raises(AssertionError, match="recall"):
        lesson11.check_fix(Fix(prefix_caching=True, window=4096, sinks=4), tiny, seeds=(0,), reveal=False)
    # The playtest's loophole: thousands of sinks kept whole on the checkpoint were its whole chat.
    with pytest.raises(AssertionError, match="recall"):
        lesson11.check_fix(Fix(window=1024, sinks=4096), tiny, seeds=(0,))
    with pytest.raises(AssertionError, match="Fix"):
        lesson11.check_fix({"prefix_caching": True}, tiny)
    assert INCIDENT.judge(Fix(prefix_caching=True, kv_dtype="int4"), (0,), tiny).quality.recall == 1.0


def test_pooled_p99_pools_the_traces_and_keeps_each_ones_own():
    """The at-scale half of judge: one P99 over every turn of the traces, each trace's own beside it, and a
    remembered replay that is the replay itself."""
    small = dataclasses.replace(INCIDENT, shape=dataclasses.replace(INCIDENT.shape, sessions=3, turns=3))
    fix = Fix(kv_dtype="int8")
    pooled, _, each = small.pooled_p99(fix, (0, 1))
    assert each == tuple(small.pooled_p99(fix, (seed,))[0] for seed in (0, 1))
    assert min(each) - 1e-9 <= pooled <= max(each) + 1e-9
    fresh = at_scale(small.trace(0), fix, small.cfg, small.gpu)
    remembered = small.at_scale(fix, 0)
    assert remembered is small.at_scale(fix, 0)
    assert [r.tpot_ms for r in remembered.report.results] == [r.tpot_ms for r in fresh.report.results]
