"""Chat sessions: the cache always equals a fresh prefill of the kept context, and rebuilds are counted exactly."""

import functools
import math

import pytest
import torch
from torch.testing import assert_close

from kvlab import Decoder, ModelConfig
from kvlab.cache.policy.window import WindowKVCache
from kvlab.measure.session import ChatSession, Rebuild

from .helpers import assert_greedy_picks

CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=97, max_seq_len=256)
PER_TOKEN = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4  # K and V, every layer, fp32
# A session's logits come from a cache filled by several prefills and decode steps, the reference from one forward
# pass (SDPA's causal kernel, other matmul shapes): the same sums in another order, a few fp32 ulps on logits below 1.
# Attending to a dropped turn, or from a wrong position, moves them by far more.
TOL = dict(rtol=1e-5, atol=1e-5)
SYSTEM = list(range(1, 6))  # 5 tokens
# Turns of 6 user tokens and a 4-token scripted reply, each turn's ids distinct from every other's.
TURNS = [(list(range(10 * i, 10 * i + 6)), list(range(10 * i + 6, 10 * i + 10))) for i in range(1, 6)]


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(CFG, device="cpu", seed=0)


def fresh_logits_all(model: Decoder, context: list[int]) -> torch.Tensor:
    """Next-token logits after every position of ``context``, ``[T, V]``, from one uncached forward pass."""
    with torch.no_grad():
        return model(torch.tensor([context]))[0]


def fresh_logits(model: Decoder, context: list[int]) -> torch.Tensor:
    """Next-token logits after ``context``, from one uncached forward pass."""
    return fresh_logits_all(model, context)[-1]


def test_turns_share_one_cache_and_count_their_steps(model):
    session = ChatSession(model, SYSTEM)
    session.turn(*TURNS[0])
    context_before_reply = [*SYSTEM, *TURNS[0][0], *TURNS[0][1], *TURNS[1][0]]
    generated = session.turn(TURNS[1][0], 3)
    assert session.context == [*context_before_reply, *generated]
    # The reply is greedy: each token is the argmax of a fresh forward pass over what came before it (to a tie
    # within TOL, which the session's cached path may break the other way).
    assert len(generated) == 3
    assert_greedy_picks(torch.tensor(generated), fresh_logits_all(model, session.context)[-4:-1], **TOL)
    assert_close(session.logits, fresh_logits(model, session.context), **TOL)
    assert session.decode_steps == 4 + 3
    assert session.prefill_tokens == 5 + 6 + 6
    # A reply token's step reads every token up to and including itself.
    contexts = [5 + 6 + i for i in range(1, 5)] + [15 + 6 + i for i in range(1, 4)]
    assert session.kv_bytes_read == sum(contexts) * PER_TOKEN
    assert session.rebuilds == [] and session.reprefill_tokens == 0


def test_cap_drops_the_oldest_turns_keeps_the_system_prompt_and_counts_the_rebuild(model):
    session = ChatSession(model, SYSTEM, cap=30)
    for user, reply in TURNS[:3]:
        session.turn(user, reply)
    # Turn 3 would reach 5 + 3 x 10 = 35 > 30, so turn 1 went first.
    assert session.context == [*SYSTEM, *TURNS[1][0], *TURNS[1][1], *TURNS[2][0], *TURNS[2][1]]
    assert_close(session.logits, fresh_logits(model, session.context), **TOL)
    (rebuild,) = session.rebuilds
    assert rebuild.reason == "cap" and rebuild.turns_dropped == 1
    assert (rebuild.context_before, rebuild.context_after, rebuild.tokens_reprefilled) == (25, 15, 15)
    assert rebuild.reusable_prefix == 5  # the system prompt; turn 2 moved to new positions
    assert rebuild.kv_bytes_written == 15 * PER_TOKEN
    assert rebuild.kv_bytes_saved_per_step == (25 - 15) * PER_TOKEN
    assert rebuild.seconds >= 0
    assert session.reprefill_tokens == 15 and session.prefill_tokens == 5 + 3 * 6
    session.turn(*TURNS[3])
    assert len(session.context) <= 30 and session.context[:5] == SYSTEM
    assert [r.turns_dropped for r in session.rebuilds] == [1, 1]


def test_compaction_replaces_old_turns_with_the_summary(model):
    session = ChatSession(model, SYSTEM)
    for user, reply in TURNS[:3]:
        session.turn(user, reply)
    summary = [90, 91, 92]
    rebuild = session.compact(summary, keep_last_turns=1)
    assert session.context == [*SYSTEM, *summary, *TURNS[2][0], *TURNS[2][1]]
    assert_close(session.logits, fresh_logits(model, session.context), **TOL)
    assert rebuild.reason == "compaction" and rebuild.turns_dropped == 2
    assert (rebuild.context_before, rebuild.context_after) == (35, 18)
    assert rebuild.kv_bytes_written == 18 * PER_TOKEN
    assert rebuild.kv_bytes_saved_per_step == 17 * PER_TOKEN
    session.turn(*TURNS[3])
    assert session.context == [*SYSTEM, *summary, *TURNS[2][0], *TURNS[2][1], *TURNS[3][0], *TURNS[3][1]]
    assert_close(session.logits, fresh_logits(model, session.context), **TOL)


def test_a_cap_keeps_the_summary_too(model):
    session = ChatSession(model, SYSTEM, cap=28)
    session.turn(*TURNS[0])
    session.compact([90, 91, 92])
    for user, reply in TURNS[1:4]:
        session.turn(user, reply)
    # 8 pinned + turns 3 and 4 = 28: turn 2 went when turn 4 came.
    assert session.context == [*SYSTEM, 90, 91, 92, *TURNS[2][0], *TURNS[2][1], *TURNS[3][0], *TURNS[3][1]]
    assert session.rebuilds[-1].reusable_prefix == 8  # system prompt and summary


def test_a_window_cache_bounds_what_each_step_reads(model):
    make_cache = functools.partial(WindowKVCache.for_model, window=8, sinks=2)
    session = ChatSession(model, SYSTEM, make_cache=make_cache)
    for user, reply in TURNS[:3]:
        session.turn(user, reply)
    assert session.cache.bytes_read_per_step() == (2 + 8) * PER_TOKEN
    rebuild = session.compact([90], keep_last_turns=1)  # 35 tokens to 16: both past the window's 10
    assert rebuild.kv_bytes_saved_per_step == 0 and rebuild.break_even_steps(10.0) == math.inf


def test_break_even_steps_is_rebuild_time_over_time_saved_per_step():
    rebuild = Rebuild("cap", 1, 1000, 200, 5, 200 * 64, kv_bytes_saved_per_step=10**6, seconds=0.01)
    # Each step streams 1 MB less: 0.1 ms at 10 GB/s, so 10 ms of re-prefill pays back after 100 steps.
    assert rebuild.break_even_steps(10.0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match=r"bandwidth_gbps: 0; allowed"):
        rebuild.break_even_steps(0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: ChatSession(m, SYSTEM, cap=5), r"cap: 5 .*: an integer >= 6 \(above the system prompt's 5 tokens\)"),
        (lambda m: ChatSession(m, [1, 200]), r"system: .*allowed: zero or more token ids in 0 \.\. 96"),
        (lambda m: ChatSession(m, SYSTEM).turn([], 2), r"user: \(\) .*allowed: one or more token ids"),
        (lambda m: ChatSession(m, SYSTEM).turn([1], -1), r"reply: -1 .*: an integer >= 0 \(a number of tokens"),
        (lambda m: ChatSession(m, SYSTEM).turn([1], [1.5]), r"reply: .*allowed"),
        (lambda m: ChatSession(m, SYSTEM, cap=12).turn(list(range(6)), 3), r"cap: 12 .*allowed: a cap >= 14"),
        (lambda m: ChatSession(m, SYSTEM).compact([1], keep_last_turns=1), r"keep_last_turns: 1 .*in \[0, 0\]"),
        (lambda m: ChatSession(m, SYSTEM, cap=8).compact([1, 2, 3, 4]), r"summary: 4 tokens .*past cap=8"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_allowed_values(model, call, message):
    with pytest.raises(ValueError, match=message):
        call(model)
