"""Lesson 05's checkers (prefix caching): right answers pass silently; likely slips fail with a message naming the
fix; hidden-style calls withhold the expected value; measured checks grade the arithmetic on fabricated data, and say,
without failing, when that data does not show the effect or contradicts the lesson."""

from __future__ import annotations

import math
import statistics

import pytest

from autograde import hidden
from kvlab import Decoder, checks
from kvlab.course import lesson05_prefix_caching as l05
from kvlab.engine import Engine, Request, RequestResult, RunReport
from kvlab.metrics import RequestTiming
from tests.helpers import assert_fails, assert_silent


# -- reference answers, written the way a learner would -------------------------------------------------------------
def block_hashes(token_ids, block_size):
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


def prefix_hit_tokens(cached_hashes, token_ids, block_size):
    hits = 0
    for h in block_hashes(token_ids, block_size):
        if h not in cached_hashes:
            break
        hits += 1
    return min(hits, (len(token_ids) - 1) // block_size) * block_size


def turn_hits(message_lens, answer_lens, block_size):
    hits, prompt, stored = [], 0, 0
    for message, answer in zip(message_lens, answer_lens, strict=True):
        prompt += message
        hits.append(min(stored // block_size, (prompt - 1) // block_size) * block_size)
        stored, prompt = prompt + answer - 1, prompt + answer
    return hits


def ttft_saved(records):
    saved = []
    for turn in sorted({r["turn"] for r in records}):
        on = statistics.median(r["ttft_on_ms"] for r in records if r["turn"] == turn)
        off = statistics.median(r["ttft_off_ms"] for r in records if r["turn"] == turn)
        saved.append((off - on, (off - on) / off))
    return saved


def blocks_needed(n_sessions, system_len, user_len, block_size):
    each = math.ceil((system_len + user_len) / block_size)
    shared = system_len // block_size
    return n_sessions * each, shared + n_sessions * (each - shared)


def cascade_bytes_per_step(batch, prefix_len, suffix_len, kv):
    return batch * (prefix_len + suffix_len) * kv, (prefix_len + batch * suffix_len) * kv


# -- fabricated measurements ----------------------------------------------------------------------------------------
def chat_records(on_share: float = 0.3) -> list[dict]:
    """Two sessions of three turns: turns 1 and 2 hit most of their prompt, and with caching take ``on_share`` of
    their TTFT without it."""
    records = []
    for session in range(2):
        for turn, (prompt, hits) in enumerate(((100, 0), (140, 96), (180, 128))):
            off = 10.0 + 0.5 * prompt + session
            on = off if hits == 0 else off * on_share
            records.append(
                {"session": session, "turn": turn, "message_len": 100 if turn == 0 else 30, "answer_len": 10,
                 "prompt_len": prompt, "hit_tokens": hits, "ttft_on_ms": on, "ttft_off_ms": off}
            )  # fmt: skip
    return records


def run_report(tpot_ms: float, hits: int, ttft_ms: float = 50.0, n: int = 5) -> RunReport:
    times = tuple((ttft_ms + i * tpot_ms) / 1e3 for i in range(n))
    return RunReport([RequestResult(list(range(n)), RequestTiming(times))], times[-1], hits, 0, n, 1, 4)


def tpot_data(hit_ms: float = 10.0, cold_ms: float = 10.0):
    hit = [run_report(hit_ms * f, 96, ttft_ms=5.0) for f in (1.0, 1.1, 0.95)]
    cold = [run_report(cold_ms * f, 0, ttft_ms=90.0) for f in (1.05, 0.9, 1.0)]
    return hit, cold


def cascade_sweep(per_row_slope: float = 8.0, cascade_slope: float = 3.0, batch: int = 8) -> dict:
    prefix_lens = [512, 1024, 1536, 2048]
    return {
        "prefix_lens": prefix_lens,
        "batch": batch,
        "per_row_bytes": [cascade_bytes_per_step(batch, p, 16, 8192)[0] for p in prefix_lens],
        "cascade_bytes": [cascade_bytes_per_step(batch, p, 16, 8192)[1] for p in prefix_lens],
        "per_row_ms": [5.0 + per_row_slope * p / 1e3 for p in prefix_lens],
        "cascade_ms": [5.0 + cascade_slope * p / 1e3 for p in prefix_lens],
    }


def median_tpot(runs):
    return statistics.median(r.results[0].tpot_ms for r in runs)


# -- right answers ----------------------------------------------------------------------------------------------------
def test_right_answers_pass_silently(capsys):
    assert_silent(capsys, checks.check_block_hashes, block_hashes)
    assert_silent(capsys, checks.check_prefix_hit_tokens, prefix_hit_tokens, block_hashes)
    assert_silent(capsys, checks.check_turn_hits, turn_hits)
    assert_silent(capsys, checks.check_ttft_saved, ttft_saved, chat_records())
    assert_silent(capsys, checks.check_blocks_needed, blocks_needed)
    assert_silent(capsys, checks.check_cascade_bytes, cascade_bytes_per_step)
    hit, cold = tpot_data()
    assert_silent(capsys, checks.check_tpot_after_hit, median_tpot(hit), median_tpot(cold), hit, cold)
    sweep = cascade_sweep()
    assert_silent(capsys, checks.check_cascade_slopes, 1 / 8, 3.0 / 8.0, sweep)


def test_hidden_checks_pass_right_answers(capsys):
    assert_silent(capsys, hidden.check_block_hashes, block_hashes)
    assert_silent(capsys, hidden.check_prefix_hit_tokens, prefix_hit_tokens, block_hashes)
    assert_silent(capsys, hidden.check_turn_hits, turn_hits)
    assert_silent(capsys, hidden.check_ttft_saved, ttft_saved)
    assert_silent(capsys, hidden.check_blocks_needed, blocks_needed)
    assert_silent(capsys, hidden.check_cascade_bytes, cascade_bytes_per_step)


def test_a_hash_of_the_whole_prefix_is_a_valid_chain(capsys):
    assert_silent(
        capsys, checks.check_block_hashes, lambda t, b: [hash(tuple(t[: (i + 1) * b])) for i in range(len(t) // b)]
    )


# -- exercise 1 ----------------------------------------------------------------------------------------------------
def unchained(token_ids, block_size):
    return [hash(tuple(token_ids[s : s + block_size])) for s in range(0, len(token_ids) - block_size + 1, block_size)]


@pytest.mark.parametrize(
    ("wrong", "match"),
    [
        (unchained, "describe everything before it"),
        (lambda t, b: [hash(tuple(t[: (i + 1) * b])) for i in range(math.ceil(len(t) / b))], "FULL block"),
        (lambda t, b: [object() for _ in range(len(t) // b)], "same hashes"),
        (
            lambda t, b: [hash(tuple(sorted(t[: (i + 1) * b]))) for i in range(len(t) // b)],
            "in order",
        ),
        (lambda t, b: [hash(tuple(t[: (i + 1) * b - 1])) for i in range(len(t) // b)], "Hash every token of the block"),
        (lambda t, b: [hash((i, tuple(t))) for i in range(len(t) // b)], "never on later tokens"),
        (lambda t, b: [[*t[: (i + 1) * b]] for i in range(len(t) // b)], "Hash a tuple, not a list"),
        (lambda t, b: (hash(tuple(t[: (i + 1) * b])) for i in range(len(t) // b)), "Return a list"),
    ],
)
def test_block_hashes_slips(wrong, match):
    assert_fails(checks.check_block_hashes, wrong, match=match)


def test_block_hashes_names_the_call_that_raised():
    def raises(token_ids, block_size):
        return [hash([1])]

    assert_fails(checks.check_block_hashes, raises, match=r"block_hashes\(\[.*\(48 tokens\), 16\): raised TypeError")


# -- exercise 2 ----------------------------------------------------------------------------------------------------
def leading_run(cached, tokens, size):
    run = 0
    for h in block_hashes(tokens, size):
        if h not in cached:
            break
        run += 1
    return run


@pytest.mark.parametrize(
    ("wrong", "match"),
    [
        (lambda c, t, b: leading_run(c, t, b) * b, "at least one prompt token must be computed"),
        (lambda c, t, b: min(leading_run(c, t, b) * b, len(t) - 1), "in whole blocks"),
        (lambda c, t, b: min(leading_run(c, t, b), (len(t) - 1) // b), "tokens, not blocks"),
        (lambda c, t, b: max(min(leading_run(c, t, b), len(t) // b - 1), 0) * b, "a block too many"),
    ],
)
def test_prefix_hit_tokens_slips(wrong, match):
    assert_fails(checks.check_prefix_hit_tokens, wrong, block_hashes, match=match)


def test_prefix_hit_tokens_counting_every_cached_block_fails():
    """The learner review's accepted slip: every cached block counted, the walk not stopped at the first miss."""

    def every_cached(cached, tokens, size):
        hashes = block_hashes(tokens, size)
        return min(sum(h in cached for h in hashes), (len(tokens) - 1) // size) * size

    assert_fails(checks.check_prefix_hit_tokens, every_cached, block_hashes, match="counts every cached block")


def test_prefix_hit_tokens_hidden_style_withholds_expected_value():
    message = assert_fails(
        l05.check_prefix_hit_tokens,
        lambda c, t, b: leading_run(c, t, b) * b,
        block_hashes,
        cases=hidden.CASES["check_prefix_hit_tokens"][:1],
        reveal=False,
        match="hidden check does not reveal",
    )
    assert "expected 32" not in message and "Cap" not in message


def test_prefix_hit_tokens_blames_exercise_1_when_it_raises():
    def broken(token_ids, block_size):
        raise NotImplementedError()

    assert_fails(checks.check_prefix_hit_tokens, prefix_hit_tokens, broken, match="block_hashes.*not implemented")


# -- exercise 3 ----------------------------------------------------------------------------------------------------
def hits_with(stored):
    def wrong(message_lens, answer_lens, block_size):
        hits, prompt, cached = [], 0, 0
        for message, answer in zip(message_lens, answer_lens, strict=True):
            prompt += message
            hits.append(min(cached, (prompt - 1) // block_size) * block_size)
            cached = stored(prompt, answer, block_size)
            prompt += answer
        return hits

    return wrong


@pytest.mark.parametrize(
    ("wrong", "match"),
    [
        (hits_with(lambda p, a, b: (p + a) // b), "never stored"),
        (hits_with(lambda p, a, b: p // b), "answer is cached too"),
        (hits_with(lambda p, a, b: math.ceil((p + a - 1) / b)), "FULL blocks"),
        (lambda m, a, b: [0] * len(m), "turn_hits"),
    ],
)
def test_turn_hits_slips(wrong, match):
    assert_fails(checks.check_turn_hits, wrong, match=match)


def test_turn_hits_agrees_with_the_engines_records():
    """The lesson's own chat: records the engine served are the expected values, per session."""
    records = [
        {"session": s, "turn": t, "message_len": m, "answer_len": 8, "hit_tokens": h}
        for s in range(2)
        for t, (m, h) in enumerate(((40, 0), (9, 32), (12, 64)))
    ]
    checks.check_turn_hits(turn_hits, records, 16, cases=())
    records[-1]["hit_tokens"] = 48
    assert_fails(checks.check_turn_hits, turn_hits, records, 16, cases=(), match="session 1.*what the engine served")


def test_turn_hits_rule_is_the_engines():
    """The engine the check runs serves what the rule says, also where the history is a whole number of blocks."""
    for messages, answers, size in (*l05._TURN_CASES, *hidden.CASES["check_turn_hits"]):
        assert l05._engine_turn_hits(messages, answers, size) == turn_hits(messages, answers, size)


# -- exercise 4 ----------------------------------------------------------------------------------------------------
def saved_by(on_key_stat, over_on=False, sign=1):
    def wrong(records):
        out = []
        for turn in sorted({r["turn"] for r in records}):
            on = on_key_stat(r["ttft_on_ms"] for r in records if r["turn"] == turn)
            off = on_key_stat(r["ttft_off_ms"] for r in records if r["turn"] == turn)
            out.append((sign * (off - on), (off - on) / (on if over_on else off)))
        return out

    return wrong


@pytest.mark.parametrize(
    ("wrong", "match"),
    [
        (saved_by(statistics.mean), "median over the sessions, not the mean"),
        (saved_by(statistics.median, sign=-1), "a saving is positive"),
        (saved_by(statistics.median, over_on=True), "Divide by the TTFT without caching"),
        (lambda records: [(0.0, 0.0)], "a list of 2"),
    ],
)
def test_ttft_saved_slips(wrong, match):
    assert_fails(checks.check_ttft_saved, wrong, match=match)


def unseen(capsys, *reasons: str) -> None:
    """The check passed and said on stdout, never stderr, that the run did not show the effect, for ``reasons``."""
    out, err = capsys.readouterr()
    assert err == "" and "did not show" in out and "the grade does not depend on it" in out, out
    for reason in reasons:
        assert reason in out, out


def test_ttft_unreadable_chat_is_told_not_failed(capsys):
    slow = chat_records(on_share=0.95)  # caching saved 5% of turns that hit ~70% of their prompt: load, or nothing
    assert not l05.ttft_reading(slow).seen and l05.ttft_reading(chat_records()).seen
    checks.check_ttft_saved(ttft_saved, slow)
    unseen(capsys, "under 0.4")


def test_ttft_chat_that_contradicts_the_lesson_says_so(capsys):
    slower = chat_records(on_share=1.3)  # turns that hit were slower with caching
    checks.check_ttft_saved(ttft_saved, slower)
    unseen(capsys, "the opposite of the lesson")


def test_ttft_wrong_arithmetic_fails_whatever_the_chat_showed():
    assert_fails(checks.check_ttft_saved, saved_by(statistics.mean), chat_records(1.3), match="not the mean")


def test_ttft_band_needs_turns_with_large_hits():
    records = [dict(r, hit_tokens=0) for r in chat_records()]
    assert_fails(checks.check_ttft_saved, ttft_saved, records, match="turns with large hits")


# -- exercise 5 ----------------------------------------------------------------------------------------------------
def shares_partial_block(n, s, u, b):
    each, system = math.ceil((s + u) / b), math.ceil(s / b)
    return n * each, system + n * (each - system)


@pytest.mark.parametrize(
    ("wrong", "match"),
    [
        (shares_partial_block, "partial last system block cannot be shared"),
        (
            lambda n, s, u, b: (n * (math.ceil(s / b) + math.ceil(u / b)), s // b + n * math.ceil(u / b)),
            "first fill the system prompt's last block",
        ),
        (lambda n, s, u, b: (n * math.ceil((s + u) / b), s // b + n * math.ceil((s + u) / b)), "shared blocks again"),
        (lambda n, s, u, b: [n, n], "a tuple"),
    ],
)  # fmt: skip
def test_blocks_needed_slips(wrong, match):
    assert_fails(checks.check_blocks_needed, wrong, match=match)


def test_blocks_needed_hidden_style_withholds_expected_value():
    message = assert_fails(
        l05.check_blocks_needed, shares_partial_block, cases=[(4, 200, 25, 16)], reveal=False, match="does not reveal"
    )
    assert "36" not in message and "partial" not in message


def test_blocks_needed_matches_the_engines_peak_blocks():
    """The lesson's engine runs, on a tiny model: concurrent sessions after a warm-up, as the notebook serves them."""
    model = Decoder(l05._CHAT_MODEL, seed=0)
    system, user, answer, size = list(range(1, 41)), 9, 2, 16
    runs = []
    for n in (1, 3):
        peaks = {}
        for caching in (False, True):
            engine = Engine(model, n_blocks=64, block_size=size, max_batch=n, token_budget=n * (len(system) + user),
                            prefix_caching=caching, clock="simulated", bandwidth_gbps=1000.0)  # fmt: skip
            if caching:
                engine.run([Request(system, 1)])
            prompts = [system + [50 + i] * user for i in range(n)]
            peaks[caching] = engine.run([Request(p, answer) for p in prompts]).peak_blocks
        runs.append({"n_sessions": n, "system_len": len(system), "user_len": user + answer - 1, "block_size": size,
                     "peak_off": peaks[False], "peak_on": peaks[True]})  # fmt: skip
    checks.check_blocks_needed(blocks_needed, runs, cases=())
    runs[-1]["peak_on"] += 1
    assert_fails(checks.check_blocks_needed, blocks_needed, runs, cases=(), match="the engine's peak_blocks")


# -- exercise 6 ----------------------------------------------------------------------------------------------------
def test_tpot_slips():
    hit, cold = tpot_data()
    mean = statistics.mean(r.results[0].tpot_ms for r in hit)
    assert_fails(checks.check_tpot_after_hit, mean, median_tpot(cold), hit, cold, match="median over the runs")
    ttft = statistics.median(r.results[0].ttft_ms for r in hit)
    assert_fails(checks.check_tpot_after_hit, ttft, median_tpot(cold), hit, cold, match="That is the TTFT")
    assert_fails(checks.check_tpot_after_hit, 1.0, 1.0, cold, hit, match="hit_runs' prefix_hit_tokens")


def test_tpot_unreadable_runs_are_told_not_failed(capsys):
    hit, cold = tpot_data(hit_ms=20.0)  # a burst of load during the hit runs: ratio 2
    assert not l05.tpot_reading(hit, cold).seen and l05.tpot_reading(*tpot_data()).seen
    checks.check_tpot_after_hit(median_tpot(hit), median_tpot(cold), hit, cold)
    unseen(capsys, "outside 0.6-1.67")
    assert_fails(checks.check_tpot_after_hit, median_tpot(cold), median_tpot(cold), hit, cold, match="tpot_hit_ms")


# -- exercise 7 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("wrong", "match"),
    [
        (lambda b, p, s, kv: ((p + s) * kv, (p + b * s) * kv), "multiply by the batch"),
        (lambda b, p, s, kv: (b * (p + s) * kv, b * (p + s) * kv), "reads the shared prefix once"),
        (lambda b, p, s, kv: (b * (p + s) * kv, (p + s) * kv), "its own suffix"),
        (lambda b, p, s, kv: (b * (p + s) * kv, (p + b * s) * kv / 1.0), "an int"),
    ],
)
def test_cascade_bytes_slips(wrong, match):
    assert_fails(checks.check_cascade_bytes, wrong, match=match)


def test_cascade_bytes_hidden_style_withholds_expected_value():
    message = assert_fails(
        hidden.check_cascade_bytes, lambda b, p, s, kv: ((p + s) * kv, (p + b * s) * kv), match="does not reveal"
    )
    per_row = 32 * (2048 + 100) * 64  # hidden.py's first case: 64 bytes per token
    assert "one row's read" not in message and str(per_row) not in message


# -- exercise 8 ----------------------------------------------------------------------------------------------------
def test_cascade_slopes_slips():
    sweep = cascade_sweep()
    assert_fails(checks.check_cascade_slopes, 8.0, 3 / 8, sweep, match="bytes_ratio.*Cascade over per row")
    assert_fails(checks.check_cascade_slopes, 1 / 8, 8 / 3, sweep, match="slope_ratio.*Cascade over per row")


def test_cascade_unreadable_sweep_is_told_not_failed(capsys):
    flat = cascade_sweep(cascade_slope=7.6)  # a cascade that barely helps: ratio 0.95
    assert not l05.cascade_reading(flat).seen and l05.cascade_reading(cascade_sweep()).seen
    checks.check_cascade_slopes(1 / 8, 7.6 / 8, flat)
    unseen(capsys, "above 0.8")


def test_cascade_line_flatter_than_its_bytes_allow_is_not_read_as_the_effect(capsys):
    """The second playtest: a cascade line that fell as the prefix grew (ratio -0.18) read as readable."""
    for slope in (-1.5, 0.3):  # ratios -0.19 and 0.0375, under half of the bytes' 1/8
        tilted = cascade_sweep(cascade_slope=slope)
        assert not l05.cascade_reading(tilted).seen
        checks.check_cascade_slopes(1 / 8, slope / 8, tilted)
        unseen(capsys, "load tilted a line")
    assert l05.cascade_reading(cascade_sweep(cascade_slope=0.6)).seen  # 0.075: above the floor, noise allowed


def test_cascade_sweep_that_contradicts_the_lesson_says_so(capsys):
    steeper = cascade_sweep(cascade_slope=9.0)
    checks.check_cascade_slopes(1 / 8, 9.0 / 8, steeper)
    unseen(capsys, "the opposite of the lesson")
    assert_fails(checks.check_cascade_slopes, 1 / 8, 8 / 9, steeper, match="slope_ratio.*Cascade over per row")


def test_cascade_per_row_line_that_does_not_rise_is_load_not_a_contradiction(capsys):
    falling = cascade_sweep(per_row_slope=-1.0)
    checks.check_cascade_slopes(1 / 8, 3.0 / -1.0, falling)
    unseen(capsys, "did not rise")
