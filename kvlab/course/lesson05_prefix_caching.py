"""Lesson 05, prefix caching: chained block hashes and the prompt tokens they serve, the hits of a multi-turn chat
and the TTFT they save, the blocks sessions hold with and without a shared system prompt, a sequence's TPOT after a
hit, and the bytes a cascade step reads for a batch that shares a prefix.

The exact answers are compared with what kvlab's own code does on the same inputs: the paged cache's prefix hits
(``PagedKVCache.new_sequence``), a run of the engine (``kvlab.engine.engine.Engine``), and the caches' own
``bytes_read_per_step``. Measured answers are compared with the learner's own runs; whether a run shows the effect
its section measures is read by that section's ``*_reading`` (kvlab.course.measured): the lesson's cell measures
again while it does not, and the check says so when it never did, without failing correct arithmetic.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from kvlab.cache.base import CacheShape
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.cache.storage.shared_prefix import SharedPrefixKVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.course.grading import call_learner, close_to, exact_int, fail, is_int
from kvlab.course.measured import Reading, reading, tell
from kvlab.engine import Engine, Request, RunReport
from kvlab.metrics import fit_line
from kvlab.model.decoder import Decoder
from kvlab.spec.config import ModelConfig

__all__ = [
    "CASCADE_MAX_RATIO",
    "CASCADE_MIN_OF_BYTES",
    "TPOT_BAND",
    "TTFT_MIN_TRACKING",
    "cascade_reading",
    "check_block_hashes",
    "check_blocks_needed",
    "check_cascade_bytes",
    "check_cascade_slopes",
    "check_prefix_hit_tokens",
    "check_tpot_after_hit",
    "check_ttft_saved",
    "check_turn_hits",
    "tpot_reading",
    "ttft_reading",
]

Tokens = tuple[int, ...]


def _ids(start: int, n: int, step: int = 7, vocab: int = 4096) -> Tokens:
    """``n`` token ids, distinct for ``n`` below ``vocab`` / gcd, that no other run of this module repeats."""
    return tuple((start + step * i) % vocab for i in range(n))


def _show(tokens: Sequence[int]) -> str:
    """A token list as a message shows it: whole when short, its ends and its length when long."""
    if len(tokens) <= 12:
        return str(list(tokens))
    return f"[{', '.join(map(str, tokens[:4]))}, ..., {tokens[-1]}] ({len(tokens)} tokens)"


# -- exercise 1: chained block hashes ---------------------------------------------------------------------------------
_HASH_CASES: tuple[tuple[Tokens, int], ...] = (
    (_ids(100, 48), 16),  # three full blocks
    (_ids(9, 37, step=3), 8),  # four full blocks and a partial one
    ((5, 6, 7, 8) * 3 + (9,), 4),  # one block's tokens three times, at three positions
    (_ids(11, 3), 4),  # no full block
)
_CHAIN_FIX = (
    "A block's hash must describe everything before it as well as its own tokens: the same tokens after another "
    "prefix have other K/V. Section 1 (exercise 1's text) says how the hashes chain."
)


def _hashes(fn: Callable, tokens: Sequence[int], block_size: int, label: str) -> list:
    got = call_learner(label, fn, list(tokens), block_size)
    if isinstance(got, (str, bytes)) or not isinstance(got, Sequence):
        fail(label, got, "a list of hashes, one per full block", "Return a list (not a generator or a set).")
    n_full = len(tokens) // block_size
    if len(got) != n_full:
        fix = (
            f"One hash per FULL block ({n_full} here). A partial last block gets none: its tokens are not all "
            "known yet, and only whole blocks are shared."
        )
        fail(f"{label}: number of hashes", len(got), f"{n_full}", fix)
    for h in got:
        try:
            hash(h)
        except TypeError:
            fail(f"{label}: a hash", h, "a hashable value (an int)", "Hash a tuple, not a list: hash(tuple(...)).")
    return list(got)


def _changed(tokens: Tokens, i: int) -> Tokens:
    return (*tokens[:i], tokens[i] + 1000, *tokens[i + 1 :])


def check_block_hashes(fn: Callable[[Sequence[int], int], Sequence[Hashable]], cases=_HASH_CASES, reveal=True) -> None:
    """``fn(token_ids, block_size)`` -> one chained hash per full block, checked by its properties (any hash
    function will do): deterministic; a change at token i changes the hashes of block i // block_size onward and
    none before it; swapping two tokens of a block changes its hash; equal blocks at other positions differ.

    ``reveal`` is accepted for the hidden checks' sake: no message here shows an expected hash.
    """
    for tokens, size in cases:
        label = f"block_hashes({_show(tokens)}, {size})"
        first = _hashes(fn, tokens, size, label)
        if _hashes(fn, tokens, size, label) != first:
            fail(label, "other hashes on a second call", "the same hashes for the same tokens", _DETERMINISTIC)
        if len(set(first)) != len(first):
            fail(label, "two blocks with one hash", "a different hash for every block of one sequence", _CHAIN_FIX)
        n_full = len(first)
        positions = sorted({p for b in range(n_full) for p in (b * size, b * size + size - 1, b * size + size // 2)})
        for i in positions:
            block = i // size
            again = _hashes(fn, _changed(tokens, i), size, label)
            where = f"{label} with token {i} (in block {block}) changed"
            if again[:block] != first[:block]:
                fix = "A block's hash must depend on its own tokens and the blocks before it, never on later tokens."
                fail(where, f"a hash before block {block} changed", f"blocks 0..{block - 1} unchanged", fix)
            if again[block] == first[block]:
                fix = (
                    f"Hash every token of the block: block b is token_ids[b * block_size:(b + 1) * block_size] "
                    f"(here token {i} is in block {block})."
                )
                fail(where, f"block {block}'s hash unchanged", f"a new hash for block {block}", fix)
            unchanged = [b for b in range(block + 1, n_full) if again[b] == first[b]]
            if unchanged:
                fail(where, f"block {unchanged[0]}'s hash unchanged", "every later block's hash changed", _CHAIN_FIX)
        for b in range(n_full):
            start, chunk = b * size, tokens[b * size : (b + 1) * size]
            j = next((j for j in range(1, size) if chunk[j] != chunk[0]), None)
            if j is None:
                continue
            swapped = list(tokens)
            swapped[start], swapped[start + j] = swapped[start + j], swapped[start]
            if _hashes(fn, swapped, size, label)[b] == first[b]:
                fix = "Hash the block's tokens in order, as a tuple: a sum or a set cannot tell 'a b' from 'b a'."
                fail(f"{label} with tokens {start} and {start + j} swapped", "the same hash", "another hash", fix)


_DETERMINISTIC = (
    "The same tokens must give the same hashes on every call, so that a later request finds them: hash the "
    "tokens themselves (no id(), no random numbers, no counter)."
)


# -- exercise 2: prefix hits ----------------------------------------------------------------------------------------
_SYSTEM = _ids(1000, 40)
_CHAT = _SYSTEM + _ids(2001, 30)  # 70 tokens: four full blocks of 16 and six tokens
_HIT_CASES: tuple[tuple[tuple[Tokens, ...], Tokens, int], ...] = (
    ((_CHAT,), _CHAT[:48] + _ids(7, 10), 16),  # three cached blocks, then new tokens
    ((_CHAT,), _CHAT[:64], 16),  # every block cached, the prompt a whole number of blocks: one must be computed
    ((_CHAT,), _CHAT[:40], 16),  # two cached blocks and a partial third (the cap must not take a block away)
    ((_CHAT,), _SYSTEM + _ids(3000, 30), 16),  # the system prompt's two full blocks; block 2 differs
    ((), _CHAT, 16),  # an empty cache
    ((_CHAT,), _CHAT[:10], 16),  # shorter than a block
    ((_CHAT, _SYSTEM + _ids(5, 20)), _SYSTEM + _ids(5, 20) + _ids(77, 3), 8),  # two cached prompts, block size 8
)


def _tiny_pool(n_blocks: int, block_size: int) -> PagedKVCache:
    """A paged cache whose K/V are one number per token: what it stores does not matter here, only its blocks."""
    return PagedKVCache(CacheShape(1, 1, 1), 0, n_blocks=n_blocks, block_size=block_size)  # no sequence yet


def _cache_prompts(cache: PagedKVCache, prompts: Iterable[Sequence[int]]) -> None:
    """Store each prompt (its K/V computed, here random) and free it: its full blocks stay cached, as in the engine."""
    for prompt in prompts:
        seq, n_cached = cache.new_sequence(prompt)
        cache.use([seq])
        cache.fast_fill(len(prompt) - n_cached)
        cache.free(seq)


def _kvlab_hits(cached: Sequence[Sequence[int]], query: Sequence[int], block_size: int) -> tuple[int, int]:
    """(prompt tokens the paged cache serves from its cache, leading cached blocks before the cap)."""
    cache = _tiny_pool(sum(len(p) for p in (*cached, query)) // block_size + 2, block_size)
    _cache_prompts(cache, cached)
    run = len(cache.pool.cached_prefix(query))
    return cache.new_sequence(query)[1], run


def check_prefix_hit_tokens(
    fn: Callable[[set, Sequence[int], int], int],
    block_hashes: Callable[[Sequence[int], int], Sequence[Hashable]],
    cases=_HIT_CASES,
    reveal: bool = True,
) -> None:
    """``fn(cached_hashes, token_ids, block_size)`` -> prompt tokens served from the cache, exactly as kvlab's paged
    cache serves them. ``cached_hashes`` holds the learner's ``block_hashes`` of the cached prompts' full blocks."""
    for cached, query, size in cases:
        hashes = set()
        for prompt in cached:
            hashes.update(
                call_learner("block_hashes (exercise 1; this check uses it)", block_hashes, list(prompt), size)
            )
        label = f"prefix_hit_tokens(hashes of {len(cached)} cached prompt(s), {len(query)}-token prompt, {size})"
        want, run = _kvlab_hits(cached, query, size)
        cap = (len(query) - 1) // size
        slips = (
            (run * size, "It serves the whole prompt from the cache: at least one prompt token must be computed, "
             "since its logits give the first output token (the cap in exercise 2's text, section 1)."),
            (min(run * size, len(query) - 1), "It caps in tokens: the cap is in whole blocks, since a block is "
             "shared whole or not at all."),
            (min(run, cap), "Return tokens, not blocks: multiply by block_size."),
            (max(min(run, len(query) // size - 1), 0) * size, "It takes a block too many away when the prompt ends "
             "in a partial block: its last token is then in that block, which is never cached anyway."),
        )  # fmt: skip
        fix = "Not the hits the walk in section 1 serves: see how it starts, where it stops, and the cap."
        got = call_learner(label, fn, set(hashes), list(query), size)
        exact_int(label, got, want, "tokens", fix, reveal, [(v, s) for v, s in slips if v != want])
    _check_hit_walk_stops(fn, block_hashes)


def _check_hit_walk_stops(fn: Callable[[set, Sequence[int], int], int], block_hashes: Callable) -> None:
    """A cached set with a hole: every block of ``_CHAT`` but the second. No cache of chained hashes holds such a set
    (a block is cached only after its parent, and evicted before it), so counting every cached block agrees with the
    walk on every real cache; the lesson's rule still decides this one: the first miss ends the walk, one block hit.
    The learner review found the count of every cached block accepted without this case."""
    hashes = list(call_learner("block_hashes (exercise 1; this check uses it)", block_hashes, list(_CHAT), 16))
    label = "prefix_hit_tokens(every block of a 70-token prompt cached but the second, that prompt, 16)"
    got = call_learner(label, fn, set(hashes[:1] + hashes[2:]), list(_CHAT), 16)
    slips = ((48, "It counts every cached block: the walk stops at the first block whose hash is not cached."),)
    fix = "Count the leading blocks whose hash is cached, stopping at the first miss, times block_size."
    exact_int(label, got, 16, "tokens", fix, True, slips)


# -- exercise 3: a chat's hits, turn by turn --------------------------------------------------------------------------
# The engine the check runs a chat through: small enough that a trace of a few turns takes milliseconds.
_CHAT_MODEL = ModelConfig(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=97, max_seq_len=2048)
_TURN_CASES: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] = (
    ((40, 9, 12, 30), (8, 8, 8, 8), 16),  # turn 1's history, 40 + 8 - 1 = 47 tokens, fills 2 blocks and 15 of 16
    ((21, 14, 3), (12, 7, 2), 8),  # 21 + 12 - 1 = 32: stored history a whole number of blocks
    ((16, 5, 5), (1, 4, 6), 16),  # one output token: no decode, the prompt alone is stored
)


def _engine_turn_hits(message_lens: Sequence[int], answer_lens: Sequence[int], block_size: int) -> list[int]:
    """Prefix hit tokens of each turn of one chat, served by kvlab's engine with prefix caching, turn after turn:
    turn t + 1's prompt is turn t's prompt, its answer, and a new message of ``message_lens[t + 1]`` tokens."""
    model = Decoder(_CHAT_MODEL, seed=0)
    total = sum(message_lens) + sum(answer_lens)
    engine = Engine(
        model, n_blocks=total // block_size + 2, block_size=block_size, token_budget=total, clock="simulated",
        bandwidth_gbps=1000.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(sum(message_lens) + block_size)
    prompt: list[int] = []
    hits = []
    for message, answer in zip(message_lens, answer_lens, strict=True):
        prompt += torch.randint(0, _CHAT_MODEL.vocab_size, (message,), generator=gen).tolist()
        report = engine.run([Request(tuple(prompt), answer)])
        hits.append(report.prefix_hit_tokens)
        prompt += report.results[0].output_ids
    return hits


def _turn_rule(message_lens: Sequence[int], answer_lens: Sequence[int], size: int, cached: Callable) -> list[int]:
    """Hits per turn if the previous turn left ``cached(prompt_len, answer_len, block_size)`` blocks cached."""
    hits, prompt = [0], message_lens[0]
    for message, answer in zip(message_lens[1:], answer_lens, strict=False):
        blocks = cached(prompt, answer, size)
        prompt += answer + message
        hits.append(min(blocks, (prompt - 1) // size) * size)
    return hits


_TURN_SLIPS: tuple[tuple[Callable[[int, int, int], int], str], ...] = (
    (lambda p, a, b: (p + a) // b, "The answer's last token is sampled, never stored: the previous turn left "
     "prompt + answer - 1 tokens in the pool."),
    (lambda p, a, b: p // b, "The answer is cached too: the engine feeds the generated tokens to the pool, so the "
     "previous turn left its prompt and its answer (but the last answer token) cached."),
    (lambda p, a, b: math.ceil((p + a - 1) / b), "Only FULL blocks are cached: round the stored tokens down to "
     "whole blocks."),
)  # fmt: skip


def _check_turns(label: str, got: Any, want: list[int], fix: str, reveal: bool, slips: Sequence[tuple]) -> None:
    if isinstance(got, (str, bytes)) or not isinstance(got, Sequence) or len(got) != len(want):
        fail(label, got, f"a list of {len(want)} ints, one per turn", "Return one hit count per turn, turn 0 first.")
    for turn, value in enumerate(got):
        if not is_int(value):
            fail(f"{label}[{turn}]", value, "an int number of tokens", "Return ints.")
    if list(got) != want:
        hint = next((" " + slip for value, slip in slips if value == list(got) and value != want), "")
        fail(label, list(got), "prompt tokens per turn", fix + hint if reveal else fix, want, reveal)


def check_turn_hits(
    fn: Callable[[Sequence[int], Sequence[int], int], Sequence[int]],
    records: Sequence[Mapping[str, Any]] = (),
    block_size: int | None = None,
    cases=_TURN_CASES,
    reveal: bool = True,
) -> None:
    """``fn(message_lens, answer_lens, block_size)`` -> prefix hit tokens of each turn of one chat, starting from an
    empty cache: turn t's prompt is turn t - 1's prompt, its answer (``answer_lens[t - 1]`` tokens) and a new message
    of ``message_lens[t]`` tokens; turn 0's prompt is ``message_lens[0]`` tokens.

    Compared with the hits kvlab's engine served: in the lesson's own chat (``records``, one dict per session and
    turn with "session", "turn", "message_len", "answer_len" and "hit_tokens", served with ``block_size``), and in
    chats of ``cases``, each run here through a small engine.
    """
    fix = (
        "Not the hits the engine served: section 2 says what a turn leaves in the pool for the next one, and "
        "exercise 2's cap still applies."
    )
    sessions: dict[Any, list[Mapping[str, Any]]] = {}
    for r in records:
        sessions.setdefault(r["session"], []).append(r)
    for session, turns in sessions.items():
        turns = sorted(turns, key=lambda r: r["turn"])
        messages, answers = [r["message_len"] for r in turns], [r["answer_len"] for r in turns]
        label = f"turn_hits({messages}, {answers}, {block_size}) for session {session} of your chat"
        got = call_learner(label, fn, messages, answers, block_size)
        slips = [(_turn_rule(messages, answers, block_size, s), m) for s, m in _TURN_SLIPS]
        _check_turns(label, got, [r["hit_tokens"] for r in turns], fix + " (expected: what the engine served)",
                     True, slips)  # fmt: skip
    for messages, answers, size in cases:
        label = f"turn_hits({list(messages)}, {list(answers)}, {size})"
        got = call_learner(label, fn, list(messages), list(answers), size)
        slips = [(_turn_rule(messages, answers, size, s), m) for s, m in _TURN_SLIPS]
        _check_turns(label, got, _engine_turn_hits(messages, answers, size), fix, reveal, slips)


# -- exercise 4: the TTFT a turn saves ------------------------------------------------------------------------------
def _per_turn(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """The median of ``key`` over the sessions, per turn, turn 0 first."""
    turns = sorted({r["turn"] for r in records})
    return [statistics.median(r[key] for r in records if r["turn"] == t) for t in turns]


def _ttft_saved(records: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    on, off = _per_turn(records, "ttft_on_ms"), _per_turn(records, "ttft_off_ms")
    return [(b - a, (b - a) / b) for a, b in zip(on, off, strict=True)]


def _fake_records(ttft: Sequence[Sequence[tuple[float, float]]]) -> list[dict[str, Any]]:
    """Records of a made-up chat, with every key the lesson's records have: ``ttft[session][turn]`` = (ttft_on_ms,
    ttft_off_ms); 100-token first messages, 20-token answers and messages, blocks of 16."""
    return [
        {"session": s, "turn": t, "message_len": 20 if t else 100, "answer_len": 20, "prompt_len": 100 + 40 * t,
         "hit_tokens": (100 + 40 * t - 21) // 16 * 16 if t else 0, "ttft_on_ms": on, "ttft_off_ms": off,
         "same_tokens": True}
        for s, turns in enumerate(ttft)
        for t, (on, off) in enumerate(turns)
    ]  # fmt: skip


_TTFT_CASES = (
    # three sessions, so that the median differs from the mean
    _fake_records([[(50.0, 52.0), (20.0, 80.0)], [(48.0, 47.0), (22.0, 70.0)], [(60.0, 55.0), (40.0, 90.0)]]),
    _fake_records([[(3.5, 3.25), (1.0, 4.0), (1.5, 6.0)]]),
)

# How closely the TTFT a turn saves follows its hits: (TTFT saved / TTFT without caching) over (prompt tokens hit /
# prompt tokens), for each session and turn whose hits are at least TTFT_LARGE_HIT of its prompt; the check takes
# the median. A prefill's time is mostly its computed tokens' time, so the ratio is near 1, a little below: a prefill
# also pays for what no prompt length changes (the weights read once, the engine's step) and the computed tokens
# attend over the cached ones. Measured with lesson 05's solution on the course's 2-core AMD EPYC, one thread, while
# two other lessons ran on the same cores (load average 4.2-8.3): 40 quick-mode runs under nbgrader (cpu-tiny,
# prompts of 128-272 tokens, hit shares 0.73-0.82) gave medians of 0.80-0.93 (single turns from 0.71); four
# full-mode runs (cpu-small, 512-1152 tokens, hit shares 0.82-0.91) gave 0.94-0.99 per turn. Hits that saved nothing
# would give 0.
# TTFT_MIN_TRACKING sits at half the lowest median: a chat is readable (ttft_reading) at that or more, and the chat
# cell plays it again (kvlab.course.measured.retake) while it is not.
TTFT_LARGE_HIT = 0.5
TTFT_MIN_TRACKING = 0.4


def _tracking(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Median over large-hit (session, turn)s of saved share / hit share; None where there are none."""
    ratios = [
        (1 - r["ttft_on_ms"] / r["ttft_off_ms"]) / (r["hit_tokens"] / r["prompt_len"])
        for r in records
        if r["hit_tokens"] >= TTFT_LARGE_HIT * r["prompt_len"]
    ]
    return statistics.median(ratios) if ratios else None


def ttft_reading(records: Sequence[Mapping[str, Any]]) -> Reading:
    """Whether the chat's ``records`` show the lesson's effect: over the turns whose hits are large, the TTFT saved
    follows the share of the prompt that hit (a median of at least ``TTFT_MIN_TRACKING``)."""
    tracking = _tracking(records)
    if tracking is None:
        return reading("no turn whose hits reach half of its prompt", ["no turn with large hits to read"])
    unmet = []
    if tracking <= 0:
        unmet.append(f"turns with large hits were no faster with caching ({tracking:.2f}): the opposite of the lesson")
    elif tracking < TTFT_MIN_TRACKING:
        unmet.append(f"the saving tracks the hits only {tracking:.2f}x, under {TTFT_MIN_TRACKING}")
    return reading(f"median (share of TTFT saved) / (share of the prompt hit) {tracking:.2f}", unmet)


def check_ttft_saved(
    fn: Callable[[Sequence[Mapping[str, Any]]], Sequence[tuple[float, float]]],
    records: Sequence[Mapping[str, Any]] = (),
    cases=_TTFT_CASES,
    reveal: bool = True,
) -> None:
    """``fn(records)`` -> per turn, turn 0 first, ``(saved_ms, saved_fraction)``: the median TTFT over the sessions
    without prefix caching minus the median with it, and that over the median without.

    Graded on the lesson's chat (``records``: dicts with "session", "turn", "prompt_len", "hit_tokens",
    "ttft_on_ms", "ttft_off_ms") and on ``cases``; ``ttft_reading`` says whether the chat showed turns with large
    hits saving about their hit share.
    """
    for data in (*([records] if records else []), *cases):
        want = _ttft_saved(data)
        on = _per_turn(data, "ttft_on_ms")
        label = f"ttft_saved(records of {len(want)} turns x {len(data) // len(want)} sessions)"
        got = call_learner(label, fn, data)
        if isinstance(got, (str, bytes)) or not isinstance(got, Sequence) or len(got) != len(want):
            fail(
                label,
                got,
                f"a list of {len(want)} (saved_ms, saved_fraction), one per turn",
                "Return one pair per turn found in the records (r['turn']), turn 0 first.",
            )
        for turn, (pair, (saved_ms, fraction)) in enumerate(zip(got, want, strict=True)):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                fail(f"{label}[{turn}]", pair, "a pair (saved_ms, saved_fraction)", "Return two numbers per turn.")
            means = [statistics.mean(r[k] for r in data if r["turn"] == turn) for k in ("ttft_on_ms", "ttft_off_ms")]
            diffs = [r["ttft_off_ms"] - r["ttft_on_ms"] for r in data if r["turn"] == turn]
            slips = (
                (means[1] - means[0], "Take the median over the sessions, not the mean."),
                (
                    statistics.median(diffs),
                    "Take the difference of the two medians, not the median of the differences.",
                ),
                (-saved_ms, "The TTFT without caching minus the TTFT with it: a saving is positive."),
            )
            fix = "Not the saving exercise 4 (section 2) defines: check which medians it takes, and their order."
            close_to(f"{label}[{turn}] saved_ms", pair[0], saved_ms, "ms", fix, reveal, slips=slips)
            slips = ((saved_ms / on[turn], "Divide by the TTFT without caching: the share of what the turn cost."),)
            fix = "Not the share exercise 4 (section 2) defines: check what it divides the saving by."
            close_to(f"{label}[{turn}] saved_fraction", pair[1], fraction, "share", fix, reveal, slips=slips)
    if not records:
        return
    tracking = _tracking(records)
    if tracking is None:
        fail(
            "the chat",
            "no turn whose hits reach half of its prompt",
            "turns with large hits",
            "Run more turns, or shorter new messages, so that later turns find most of their prompt cached.",
        )
    tell("turns with large hits saving about their hit share of the TTFT", ttft_reading(records))


# -- exercise 5: the blocks sessions hold -------------------------------------------------------------------------
_BLOCK_CASES: tuple[tuple[int, int, int, int], ...] = (
    (4, 200, 25, 16),  # a partial last system block (200 = 12 x 16 + 8)
    (3, 64, 10, 16),  # a system prompt of whole blocks
    (5, 30, 3, 16),  # one full system block; a session's own tokens finish the second and start a third
    (1, 100, 40, 32),  # one session: nothing to share with
    (6, 7, 9, 8),  # a system prompt shorter than a block: nothing shared
)


def _pool_blocks(n_sessions: int, system_len: int, user_len: int, block_size: int) -> tuple[int, int]:
    """Blocks that ``n_sessions`` live sequences hold in kvlab's paged cache, each a shared system prompt and its
    own tokens: ``(without prefix caching, with it once the system prompt's blocks are cached)``."""
    system = _ids(1, system_len)
    prompts = [system + _ids(4000 + 13 * i, user_len, step=11) for i in range(n_sessions)]
    held = []
    for share in (False, True):
        cache = _tiny_pool(n_sessions * math.ceil((system_len + user_len) / block_size) + 2, block_size)
        if share:
            _cache_prompts(cache, [system])
        for prompt in prompts:
            seq, n_cached = cache.new_sequence(prompt if share else ())
            cache.use([seq])
            cache.fast_fill(len(prompt) - n_cached)
        held.append(cache.pool.n_blocks - cache.pool.n_free)
    return held[0], held[1]


def check_blocks_needed(
    fn: Callable[[int, int, int, int], tuple[int, int]],
    engine_runs: Sequence[Mapping[str, int]] = (),
    cases=_BLOCK_CASES,
    reveal: bool = True,
) -> None:
    """``fn(n_sessions, system_len, user_len, block_size)`` -> ``(without_sharing, with_sharing)``: blocks held by
    ``n_sessions`` sequences of a shared ``system_len``-token prompt and ``user_len`` tokens of their own.

    Compared with kvlab's paged cache on ``cases``, then with the engine's ``peak_blocks`` in the lesson's runs
    (``engine_runs``: dicts with "n_sessions", "system_len", "user_len", "block_size", "peak_off", "peak_on").
    """
    trials = [(c, _pool_blocks(*c), reveal, "") for c in cases]
    for r in engine_runs:
        args = (r["n_sessions"], r["system_len"], r["user_len"], r["block_size"])
        trials.append((args, (r["peak_off"], r["peak_on"]), True, " (expected: the engine's peak_blocks in your run)"))
    for (n, system, user, size), want, show, source in trials:
        label = f"blocks_needed({n}, {system}, {user}, {size})"
        got = call_learner(label, fn, n, system, user, size)
        if not (isinstance(got, tuple) and len(got) == 2):
            fail(label, got, "a tuple (without_sharing, with_sharing)", "Return two ints.")
        whole, full, ceil_system = math.ceil((system + user) / size), system // size, math.ceil(system / size)
        apart = "A session's tokens fill its blocks in order: its own tokens first fill the system prompt's last block."
        fix = "Not the blocks held without sharing: section 3 (exercise 5's text) says what a session holds." + source
        slips = ((n * (ceil_system + math.ceil(user / size)), apart),)
        exact_int(f"{label}[0] (without sharing)", got[0], want[0], "blocks", fix, show, slips)
        fix = (
            "Not the blocks held with sharing: section 3 (exercise 5's text) says which blocks the sessions share "
            f"and which each holds alone.{source}"
        )
        slips = (
            (ceil_system + n * (whole - ceil_system), "A partial last system block cannot be shared: it has no hash "
             "(not full), and each session writes its own tokens into it."),
            (full + n * math.ceil(user / size), apart),
            (full + n * whole, "It counts the shared blocks again in every session: a session holds alone only "
             "the blocks that are not shared."),
        )  # fmt: skip
        exact_int(f"{label}[1] (with sharing)", got[1], want[1], "blocks", fix, show, slips)


# -- exercise 6: a sequence's TPOT after a prefix hit ---------------------------------------------------------------
# The band for TPOT after a prefix hit over TPOT after a cold prefill of the same prompt, each the median of the
# runs. A hit changes what the prefill computes, not what the decode steps read: the ratio is 1 but for noise.
# Measured with lesson 05's solution on the course's 2-core AMD EPYC, one thread, while two other lessons ran on the
# same cores (load average 4.2-8.3): 40 quick-mode runs under nbgrader (cpu-tiny, 512-token prompt, 3 runs of 16
# tokens per arm, TPOT 7-10 ms) gave 0.74-1.22; four full-mode runs (cpu-small, 1024-2048 tokens) 0.90-1.15. The
# band keeps a margin of 1.2x beyond those extremes (log-symmetric around 1). A run is readable (tpot_reading) inside
# the band, and the timing cell measures again (kvlab.course.measured.retake) while it is not.
TPOT_BAND = (0.6, 1.67)


def _median_tpot(runs: Sequence[RunReport]) -> float:
    return statistics.median(r.results[0].tpot_ms for r in runs)


def tpot_reading(hit_runs: Sequence[RunReport], cold_runs: Sequence[RunReport]) -> Reading:
    """Whether the runs show the lesson's effect: the median TPOT after a hit within ``TPOT_BAND`` of the cold one."""
    ratio = _median_tpot(hit_runs) / _median_tpot(cold_runs)
    low, high = TPOT_BAND
    unmet = [] if low <= ratio <= high else [f"the ratio is outside {low}-{high}: the two arms met different load"]
    return reading(f"TPOT after a hit / TPOT after a cold prefill {ratio:.2f}", unmet)


def check_tpot_after_hit(
    tpot_hit_ms: float,
    tpot_cold_ms: float,
    hit_runs: Sequence[RunReport],
    cold_runs: Sequence[RunReport],
) -> None:
    """The median TPOT of the runs whose prompt hit the cache and of the cold runs (each a ``RunReport`` of one
    request), graded on that arithmetic; ``tpot_reading`` says whether the runs showed the two alike."""
    for name, runs, hits in (("hit_runs", hit_runs, True), ("cold_runs", cold_runs, False)):
        if not runs or not all(isinstance(r, RunReport) and len(r.results) == 1 for r in runs):
            fail(name, runs, "a non-empty list of RunReports of one request each", "Pass what the timing cell ran.")
        if any((r.prefix_hit_tokens > 0) != hits for r in runs):
            want = "a prefix hit in every run" if hits else "no prefix hit in any run"
            fix = "Run the hit arm on the engine with prefix caching (its cache warmed), the cold one without."
            fail(f"{name}' prefix_hit_tokens", [r.prefix_hit_tokens for r in runs], want, fix)
    for name, got, runs in (("tpot_hit_ms", tpot_hit_ms, hit_runs), ("tpot_cold_ms", tpot_cold_ms, cold_runs)):
        results = [r.results[0] for r in runs]
        slips = (
            (statistics.mean(x.tpot_ms for x in results), "Take the median over the runs, not the mean."),
            (statistics.median(x.ttft_ms for x in results), "That is the TTFT: TPOT is each result's tpot_ms."),
        )
        fix = "Not the statistic exercise 6 (section 4) asks for: check which runs, which field, and which average."
        close_to(name, got, _median_tpot(runs), "ms", fix, True, rel=1e-9, slips=slips)
    tell("TPOT after a hit matching TPOT after a cold prefill", tpot_reading(hit_runs, cold_runs))


# -- exercise 7: the bytes a cascade step reads -------------------------------------------------------------------
_CASCADE_CASES: tuple[tuple[int, int, int, CacheShape], ...] = (
    (8, 4096, 64, CacheShape(2, 2, 8)),  # 128 bytes per token
    (4, 1000, 1, CacheShape(3, 1, 16, "bf16")),
    (1, 512, 30, CacheShape(1, 4, 4)),  # a batch of one: nothing to share
    (16, 300, 200, CacheShape(1, 1, 8, "fp16")),
)


def _cascade_reference(batch: int, prefix: int, suffix: int, shape: CacheShape) -> tuple[int, int, int]:
    """(per-row bytes, cascade bytes, bytes per token) of one decode step at ``prefix + suffix`` tokens, as kvlab's
    contiguous batch and shared-prefix caches count them."""
    rows = ContiguousKVCache(shape, batch, prefix + suffix)
    shared = SharedPrefixKVCache(shape, batch, prefix + suffix + 1)
    shared.fast_fill(prefix)
    shared.branch()
    context = prefix + suffix
    return rows.bytes_read_per_step(context), shared.bytes_read_per_step(context), round(rows.bytes_per_token)


def check_cascade_bytes(fn: Callable[[int, int, int, int], tuple[int, int]], cases=_CASCADE_CASES, reveal=True) -> None:
    """``fn(batch, prefix_len, suffix_len, kv_bytes_per_token)`` -> ``(per_row, cascade)``: K/V bytes one decode
    step of the batch reads when each row reads the shared prefix itself, and when the prefix is read once."""
    for batch, prefix, suffix, shape in cases:
        per_row, cascade, kv = _cascade_reference(batch, prefix, suffix, shape)
        label = f"cascade_bytes_per_step({batch}, {prefix}, {suffix}, {kv})"
        got = call_learner(label, fn, batch, prefix, suffix, kv)
        if not (isinstance(got, tuple) and len(got) == 2):
            fail(label, got, "a tuple (per_row, cascade)", "Return two ints.")
        fix = "Not what a row-by-row step reads: section 5 says what each row reads without a cascade."
        slips = (((prefix + suffix) * kv, "That is one row's read: multiply by the batch."),)
        exact_int(f"{label}[0] (per row)", got[0], per_row, "bytes", fix, reveal, slips)
        fix = "Not what a cascade step reads: section 5 says how it reads the shared prefix and each row's suffix."
        slips = (
            (per_row, "That is the per-row read: the cascade reads the shared prefix once, not once per row."),
            ((prefix + suffix) * kv, "Each row still reads its own suffix: batch x suffix_len tokens."),
        )
        exact_int(f"{label}[1] (cascade)", got[1], cascade, "bytes", fix, reveal, slips)


# -- exercise 8: the slope a cascade step keeps --------------------------------------------------------------------
# The cascade's slope over the per-row slope (decode-step time against the shared prefix's length, a batch of 8).
# Bytes alone predict 1 / batch. The cascade does not cut the FLOPs (every row's query still meets every prefix key
# and value) nor the softmax's passes over the scores; on one CPU thread those cost about as much as reading the
# prefix once, so the measured ratio sits above 1 / batch. Measured with lesson 05's solution on the course's 2-core
# AMD EPYC, one thread, while two other lessons ran on the same cores (load average 4.2-8.3), quick mode (cpu-tiny,
# prefixes of 512-2048 tokens): 21 runs timing 8 steps per point gave 0.08-0.61, 20 runs timing 12 steps (the lesson
# now) 0.13-0.51; four full-mode runs (cpu-small) 0.36-0.52. A batch that read the prefix once per row would give
# 1; CASCADE_MAX_RATIO sits between. A sweep is readable (cascade_reading) at that or less, and the sweep cell
# measures again (kvlab.course.measured.retake) while it is not. Nor is a ratio under CASCADE_MIN_OF_BYTES of what
# the bytes predict (a negative one included): the cascade still reads the prefix once, so a line flatter than half
# of that is load tilting one arm, not the cascade (a learner playtest read -0.18 as readable before this floor).
CASCADE_MAX_RATIO = 0.8
CASCADE_MIN_OF_BYTES = 0.5


def _slope_ratio(sweep: Mapping[str, Any], per_row: str, cascade: str) -> float:
    """The cascade's fitted slope over the per-row one; inf where the per-row line does not rise (load, not code)."""
    x = sweep["prefix_lens"]
    per_row_slope = fit_line(x, sweep[per_row]).slope
    return fit_line(x, sweep[cascade]).slope / per_row_slope if per_row_slope > 0 else math.inf


def cascade_reading(sweep: Mapping[str, Any]) -> Reading:
    """Whether ``sweep`` shows the lesson's effect: the cascade's step time grows at most ``CASCADE_MAX_RATIO`` as
    fast with the prefix as the per-row one's, and no less than ``CASCADE_MIN_OF_BYTES`` of what the bytes predict."""
    ratio = _slope_ratio(sweep, "per_row_ms", "cascade_ms")
    floor = CASCADE_MIN_OF_BYTES * _slope_ratio(sweep, "per_row_bytes", "cascade_bytes")
    unmet = []
    if math.isinf(ratio):
        unmet.append("the per-row line did not rise with the prefix, so there is no slope to compare with")
    elif not ratio < 1:
        unmet.append("the cascade's line was no flatter than the per-row one: the opposite of the lesson")
    elif ratio > CASCADE_MAX_RATIO:
        unmet.append(f"the cascade's slope is {ratio:.2f} of the per-row one, above {CASCADE_MAX_RATIO}")
    elif ratio < floor:
        unmet.append(
            f"the cascade's slope is {ratio:.2f} of the per-row one, under {floor:.3f}, {CASCADE_MIN_OF_BYTES} of what "
            "its bytes allow: it still reads the prefix once, so load tilted a line"
        )
    return reading(f"cascade slope / per-row slope {ratio:.3f}", unmet)


def check_cascade_slopes(bytes_ratio: float, slope_ratio: float, sweep: Mapping[str, Any]) -> None:
    """The cascade's slope over the per-row slope, predicted from bytes and measured, graded on that arithmetic;
    ``cascade_reading`` says whether the sweep showed the cascade's flatter line.

    ``sweep``: "prefix_lens", and per prefix length the step times "per_row_ms" and "cascade_ms" and the caches'
    own "per_row_bytes" and "cascade_bytes".
    """
    want = _slope_ratio(sweep, "per_row_bytes", "cascade_bytes")
    slips = ((sweep["batch"], "Cascade over per row, not per row over cascade."),)
    fix = "Not the ratio exercise 8 (section 5) asks for: use the bytes the sweep recorded for each arm."
    close_to("bytes_ratio", bytes_ratio, want, "ratio", fix, True, rel=1e-6, slips=slips)
    x = sweep["prefix_lens"]
    want = fit_line(x, sweep["cascade_ms"]).slope / fit_line(x, sweep["per_row_ms"]).slope
    slips = ((1 / want, "Cascade over per row, not per row over cascade."),)
    fix = "Not the ratio exercise 8 (section 5) asks for: use lines fitted to each arm's step times in the sweep."
    close_to("slope_ratio", slope_ratio, want, "ratio", fix, True, rel=1e-6, slips=slips)
    tell("the cascade's line flatter than the per-row one", cascade_reading(sweep))
