"""Lesson 08, heavy hitters and session caps: H2O's keep rule, the bytes a step reads under it (K/V plus the score
bookkeeping), the passkey's rank among the accumulated scores (why H2O evicts it), the steps a session rebuild
needs to pay back its re-prefill, and the time a capped chat spends, re-prefill included."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from kvlab.cache.base import CacheShape
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.cache.policy.window import WindowKVCache
from kvlab.course.grading import call_learner, close_to, config_label, exact_int, fail, is_int, is_real
from kvlab.measure.session import Rebuild
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import get_model

__all__ = [
    "check_break_even_steps",
    "check_chat_time",
    "check_h2o_bytes_per_step",
    "check_h2o_keep",
    "check_passkey_rank",
]


# -- exercise 1: the keep rule --------------------------------------------------------------------------------------
def random_case(n: int, heavy: int, recent: int, seed: int, ties: bool = False) -> tuple:
    """Scores and positions of ``n`` kept slots in shuffled slot order (as after evictions), the newest position,
    ``heavy`` and ``recent``. The ``recent`` newest positions are all there (H2O never evicts them); older ones have
    gaps where tokens were evicted. ``ties``: scores on a coarse grid, so that equal scores are common."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, generator=gen) * 5
    if ties:
        scores = (scores * 2).round() / 2
    n_recent = min(recent, n)
    older = torch.randperm(3 * n, generator=gen)[: n - n_recent].sort().values
    positions = torch.cat((older, torch.arange(3 * n, 3 * n + n_recent)))
    order = torch.randperm(n, generator=gen)  # slots are not in position order
    return tuple(scores[order].tolist()), tuple(positions[order].tolist()), int(positions[-1]), heavy, recent


_KEEP_CASES = (
    random_case(12, 4, 3, seed=1),
    random_case(40, 10, 6, seed=2),
    random_case(9, 3, 1, seed=3),  # only the newest is recent
    random_case(6, 4, 4, seed=4),  # fewer tokens than the budget: all stay
    # Position newest - recent is present and scores low: a rule that counts it as recent keeps one token too many.
    ((5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 1.0), tuple(range(8)), 7, 2, 3),
)


def _policy(heavy: int, recent: int) -> HeavyHitterKVCache:
    """A one-layer, one-head H2O cache: its ``_priority`` is kvlab's keep rule."""
    return HeavyHitterKVCache(CacheShape(1, 1, 1), heavy=heavy, recent=recent)


def h2o_kept(scores: Sequence[float], positions: Sequence[int], newest: int, heavy: int, recent: int) -> list[int]:
    """The positions kvlab's H2O keeps of these slots, sorted (one valid choice where scores tie)."""
    priority = _policy(heavy, recent)._priority(
        torch.tensor(positions), torch.tensor(scores, dtype=torch.float32), newest
    )
    best = priority.topk(min(len(scores), heavy + recent)).indices
    return sorted(int(positions[i]) for i in best)


def _as_positions(got: Any) -> list[int] | None:
    """The learner's kept positions as a sorted list of ints, or None when they are not a collection of ints."""
    if isinstance(got, torch.Tensor):
        got = got.flatten().tolist()
    if isinstance(got, (str, bytes, Mapping)) or not isinstance(got, Iterable):
        return None
    got = list(got)
    return sorted(int(p) for p in got) if all(is_int(p) for p in got) else None


def check_h2o_keep(
    fn: Callable[[Sequence[float], Sequence[int], int, int, int], Iterable[int]],
    cases: Iterable[tuple] = _KEEP_CASES,
    reveal: bool = True,
) -> None:
    """``fn(scores, positions, newest, heavy, recent)`` -> the positions H2O keeps.

    Slot ``i`` holds the token at ``positions[i]`` with accumulated attention ``scores[i]``. Kept: the ``recent``
    newest positions (``> newest - recent``), and of the others the ``heavy`` with the largest scores; every token
    when there are at most ``heavy + recent``. Where scores tie at the boundary any of the tied tokens may stay
    (kvlab breaks ties arbitrarily), so the check accepts every set that the rule allows.
    """
    for scores, positions, newest, heavy, recent in cases:
        label = f"h2o_keep({len(scores)} slots, newest={newest}, heavy={heavy}, recent={recent})"
        got = _as_positions(call_learner(label, fn, list(scores), list(positions), newest, heavy, recent))
        if got is None:
            fail(label, "not a collection of ints", "the kept positions (a list, set or tensor of ints)", _KEEP_FIX)
        want = h2o_kept(scores, positions, newest, heavy, recent)
        if got == want or _keep_is_valid(got, scores, positions, newest, heavy, recent):
            continue
        fail(
            label, got, "positions", _KEEP_FIX + _keep_hint(got, scores, positions, newest, heavy, recent), want, reveal
        )


_KEEP_FIX = (
    "Not the set section 1's keep rule (exercise 1's text) keeps: check the recent positions, the heavy hitters "
    "among the rest, and the case where every slot fits. Return positions (positions[i]), not slot indices i."
)


def _keep_is_valid(
    got: list[int], scores: Sequence[float], positions: Sequence[int], newest: int, heavy: int, recent: int
) -> bool:
    """``got`` is a set the rule allows: the right size, every recent token, and no dropped older token scoring
    above a kept one (ties at the boundary may go either way)."""
    score_of = dict(zip(positions, scores, strict=True))
    if len(set(got)) != len(got) or len(got) != min(len(scores), heavy + recent) or not set(got) <= set(positions):
        return False
    recent_set = {p for p in positions if p > newest - recent}
    if not recent_set <= set(got):
        return False
    kept_old = [score_of[p] for p in got if p not in recent_set]
    dropped = [score_of[p] for p in positions if p not in got]
    return not kept_old or not dropped or min(kept_old) >= max(dropped)


def _keep_hint(
    got: list[int], scores: Sequence[float], positions: Sequence[int], newest: int, heavy: int, recent: int
) -> str:
    """The likeliest slip that gives ``got``, or ""."""
    n = min(len(scores), heavy + recent)
    slips = [
        (
            h2o_kept(scores, positions, newest, heavy, recent - 1) if recent > 1 else None,
            "Off by one: recent means the `recent` newest positions, newest included (positions > newest - recent).",
        ),
        (
            sorted(positions[i] for i in sorted(range(len(scores)), key=lambda i: -scores[i])[:n]),
            "It keeps the top scores only: the `recent` newest stay whatever their scores (they have had no time to "
            "collect attention).",
        ),
        (
            sorted(positions[i] for i in sorted(range(len(scores)), key=lambda i: scores[i])[:heavy])
            + sorted(p for p in positions if p > newest - recent),
            "It keeps the lowest scores: keep the largest.",
        ),
        (
            sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:n]),
            "It returns slot indices: return positions[i].",
        ),
    ]
    for value, sentence in slips:
        if value is not None and sorted(value) == got:
            return " " + sentence
    if len(got) != n:
        return f" It keeps {len(got)} tokens: keep min(len(scores), heavy + recent) = {n}."
    return ""


# -- exercise 2: the bytes a decode step reads ----------------------------------------------------------------------
def _shape(cfg: ModelConfig) -> CacheShape:
    """``cfg``'s cache shape on the meta device: the byte counts, with no memory allocated for the slots."""
    return CacheShape(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.dtype, device="meta")


def _bytes_models() -> tuple[tuple[ModelConfig, int, int, int, int], ...]:
    tiny = get_model("cpu-tiny")
    llama = get_model("llama-3.1-8b")
    return (
        (tiny, 4096, 64, 64, 1),  # past the budget: every slot's score and position read to pick the eviction
        (tiny, 100, 64, 64, 1),  # within the budget: nothing evicted yet
        (llama, 32768, 1024, 1024, 8),  # bf16 K/V, fp32 scores
        (tiny.replace(n_kv_heads=2, name="cpu-tiny-gqa"), 129, 100, 28, 3),  # one past the budget
        (tiny, 128, 64, 64, 2),  # exactly the budget: full, but nothing to evict yet
    )


def check_h2o_bytes_per_step(
    fn: Callable[[ModelConfig, int, int, int, int], int],
    cases: Iterable[tuple[ModelConfig, int, int, int, int]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, context, heavy, recent, batch)`` -> bytes one decode step reads under H2O (an int).

    Expected: ``HeavyHitterKVCache.bytes_read_per_step(context)`` for ``cfg``'s shape: the K/V of the
    ``min(context, heavy + recent)`` kept tokens, plus, per sequence, layer and KV head, the fp32 score of each
    kept token (read to add this step's attention) and, once the cache is full (``context > heavy + recent``),
    every slot's score and int64 position (read to pick the token to evict).
    """
    for cfg, context, heavy, recent, batch in _bytes_models() if cases is None else cases:
        label = (
            f"h2o_bytes_per_step({config_label(cfg)}, context={context}, heavy={heavy}, recent={recent}, batch={batch})"
        )
        want = HeavyHitterKVCache(_shape(cfg), batch, heavy=heavy, recent=recent).bytes_read_per_step(context)
        kv = WindowKVCache(_shape(cfg), batch, window=heavy + recent).bytes_read_per_step(context)
        rows = batch * cfg.n_layers * cfg.n_kv_heads
        n = min(context, heavy + recent)
        slips = [
            (kv, "It is the K/V alone (a window's bytes): add the scores and positions H2O reads."),
            (
                kv + rows * n * 4,
                "It leaves out the eviction: once context > heavy + recent, every slot's score "
                "(4 B) and position (8 B) is read to find the lowest.",
            ),
            (
                want + rows * n * 4,
                "It counts the kept scores twice: the eviction's read of the scores (with the "
                "positions) is one read, the update's another; count each once.",
            ),
            (want * cfg.n_heads / cfg.n_kv_heads, "It counts n_heads: K/V and scores are per KV head."),
            (
                want - kv + kv * context / n if n else -1,
                "It reads the K/V of every token of context: H2O reads only the min(context, heavy + recent) it keeps.",
            ),
        ]
        if context == heavy + recent:
            slips.append(
                (
                    want + rows * n * 12,
                    "It picks a token to evict when the cache holds exactly heavy + recent: nothing is evicted "
                    "until the context passes the budget.",
                )
            )
        fix = (
            "Count the K/V of the tokens the cache keeps, then H2O's own bookkeeping per sequence, layer and KV head: "
            "reread the exercise's list of what a step reads and writes, and from which context eviction starts."
        )
        exact_int(label, call_learner(label, fn, cfg, context, heavy, recent, batch), want, "bytes", fix, reveal, slips)


# -- exercise 3: the passkey's rank among the accumulated scores ----------------------------------------------------
def passkey_rank(scores: torch.Tensor, positions: torch.Tensor, position: int) -> int:
    """1 + the number of kept tokens whose score is strictly above the score of the token at ``position``."""
    own = scores[positions == position]
    if own.numel() != 1:
        raise ValueError(f"position: {position} is held by {own.numel()} slots; allowed: a position held once")
    return 1 + int((scores > own).sum())


def rank_case(n: int, position_index: int, seed: int, ties: bool = False) -> tuple:
    scores, positions, *_ = random_case(n, 1, 1, seed, ties)
    return scores, positions, sorted(positions)[position_index]


_RANK_CASES = (rank_case(20, 5, seed=11), rank_case(50, 0, seed=12), rank_case(30, 29, seed=13, ties=True))


def _rank_rows(cache: HeavyHitterKVCache) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Every (layer, sequence, KV head) row of ``cache``: a label, its scores ``[n]`` and positions ``[n]``."""
    rows = []
    for layer in range(cache.n_layers):
        scores, positions = cache.attention_scores(layer), cache.kept_positions(layer)
        for b in range(scores.shape[0]):
            for h in range(scores.shape[1]):
                rows.append((f"layer {layer}, sequence {b}, KV head {h}", scores[b, h], positions[b, h]))
    return rows


def check_passkey_rank(
    fn: Callable[[torch.Tensor, torch.Tensor, int], int],
    cache: HeavyHitterKVCache | None = None,
    position: int | None = None,
    cases: Iterable[tuple] = _RANK_CASES,
    reveal: bool = True,
) -> None:
    """``fn(scores, positions, position)`` -> the rank of the token at ``position``: 1 + the number of kept tokens
    with a strictly higher score (1: the highest; tied tokens share a rank).

    With ``cache`` (your no-eviction H2O cache after the prompt) and ``position`` (the passkey's), first on every
    row of your own measurement: consistency with your data.
    """
    data = [] if cache is None else [(f"{label}", s, p, position) for label, s, p in _rank_rows(cache)]
    made_up = [(f"{len(s)} made-up slots", torch.tensor(s), torch.tensor(p), q) for s, p, q in cases]
    for where, scores, positions, pos in [*data, *made_up]:
        label = f"passkey_rank({where}, position={pos})"
        got = call_learner(label, fn, scores, positions, pos)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        want = passkey_rank(scores, positions, pos)
        own = scores[positions == pos]
        slips = (
            (want - 1, "It is the number of tokens above: the rank is 1 + that (the top token is rank 1)."),
            (int((scores < own).sum()) + 1, "It ranks from the bottom: count the scores strictly above."),
            (int((scores >= own).sum()), "It counts ties as above: count only the strictly higher scores."),
            (
                1 + int((scores > scores[pos]).sum()) if 0 <= pos < len(scores) else -1,
                "It reads scores[position]: find the slot that holds the position (positions == position).",
            ),
        )
        fix = "Not the rank exercise 3 (section 3) defines: find the slot of `position`; the top score is rank 1."
        exact_int(label, got, want, "rank (an int from 1)", fix, reveal, slips)


# -- exercise 4: the steps a rebuild needs to pay back -------------------------------------------------------------
_REBUILD_CASES = (
    (Rebuild("cap", 2, 900, 400, 32, 400 * 4096, 500 * 4096, 0.020), 10.0),
    (Rebuild("compaction", 5, 3000, 120, 40, 120 * 16384, 2880 * 16384, 0.150), 3350.0),
    (Rebuild("cap", 1, 64, 64, 64, 64 * 128, 0, 0.001), 100.0),  # a step that saves nothing never repays
)


def check_break_even_steps(
    fn: Callable[[Rebuild, float], float],
    cases: Iterable[tuple[Rebuild, float]] = _REBUILD_CASES,
    reveal: bool = True,
) -> None:
    """``fn(rebuild, bandwidth_gbps)`` -> decode steps after which the bytes the rebuild saves on each step, at
    ``bandwidth_gbps``, add up to its measured re-prefill time (``Rebuild.break_even_steps``); ``math.inf`` when a
    step saves nothing."""
    for rebuild, gbps in cases:
        label = (
            f"break_even_steps(rebuild: {rebuild.seconds * 1e3:g} ms re-prefill, saves "
            f"{rebuild.kv_bytes_saved_per_step:,} B per step; {gbps:g} GB/s)"
        )
        got = call_learner(label, fn, rebuild, gbps)
        want = rebuild.break_even_steps(gbps)
        if math.isinf(want):
            if not (is_real(got) and math.isinf(got) and got > 0):
                fail(label, got, "math.inf", "A step that saves no byte never repays the re-prefill: return math.inf.")
            continue
        saved_s = rebuild.kv_bytes_saved_per_step / (gbps * 1e9)
        slips = (
            (
                rebuild.kv_bytes_written / (gbps * 1e9) / saved_s,
                "It uses the bytes the re-prefill wrote: the cost is its measured time, rebuild.seconds.",
            ),
            (saved_s / rebuild.seconds, "It is inverted: re-prefill seconds over the seconds one step saves."),
            (rebuild.seconds * 1e3 / saved_s, "It has the re-prefill in ms: use seconds."),
        )
        fix = "Not the break-even exercise 4 (section 4) defines: check the time a step saves; a float number of steps."
        close_to(label, got, want, "decode steps", fix, reveal, rel=1e-9, slips=slips)


# -- exercise 5: the time a chat spent, re-prefill included ---------------------------------------------------------
def chat_time(turns: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """``(total_ms, reprefill_ms)`` of a timed chat: every turn's re-prefill, user prefill and decode steps."""
    reprefill = sum(t["reprefill_ms"] for t in turns)
    return reprefill + sum(t["prefill_ms"] + sum(t["decode_ms"]) for t in turns), reprefill


def made_up_turns(n: int, seed: int, rebuild_every: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    turns = []
    for i in range(n):
        steps = 3 + i % 4
        turns.append(
            {
                "context": 50 * (i + 1),
                "reprefill_ms": float(torch.rand(1, generator=gen)) * 20 if i and i % rebuild_every == 0 else 0.0,
                "prefill_ms": 1 + float(torch.rand(1, generator=gen)) * 3,
                "decode_ms": [1 + float(x) for x in torch.rand(steps, generator=gen)],
            }
        )
    return turns


_CHAT_CASES = (made_up_turns(6, seed=21, rebuild_every=2), made_up_turns(3, seed=22, rebuild_every=9))


def check_chat_time(
    fn: Callable[[Sequence[Mapping[str, Any]]], tuple[float, float]],
    measured: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    cases: Iterable[Sequence[Mapping[str, Any]]] = _CHAT_CASES,
    reveal: bool = True,
) -> None:
    """``fn(turns)`` -> ``(total_ms, reprefill_ms)``: the whole chat's time and the part spent re-prefilling.

    Each turn is a dict with ``reprefill_ms`` (a rebuild before the turn, 0 without one), ``prefill_ms`` (the user
    message), ``decode_ms`` (one time per reply token). With ``measured`` (``{name: turns}``, your timed chats),
    first on your own data.
    """
    data = [] if measured is None else [(f"your {name!r} chat", turns) for name, turns in measured.items()]
    made_up = [(f"{len(turns)} made-up turns", turns) for turns in cases]
    for where, turns in [*data, *made_up]:
        label = f"chat_time({where})"
        got = call_learner(label, fn, turns)
        if not (isinstance(got, Sequence) and len(got) == 2):
            fail(label, got, "a pair (total_ms, reprefill_ms)", "Return two numbers.")
        total, reprefill = chat_time(turns)
        slips = (
            (
                total - reprefill,
                "It leaves out the re-prefills: a rebuild runs before the turn's prefill, on the user's clock.",
            ),
            (total - sum(t["prefill_ms"] for t in turns), "It leaves out the user messages' prefill."),
        )
        fix = "Add every piece of work each turn runs on the user's clock, in ms: reread what a turn holds."
        close_to(f"{label} total_ms", got[0], total, "ms", fix, reveal, rel=1e-9, slips=slips)
        fix = "Only the rebuilds' part of that time, over all turns."
        close_to(f"{label} reprefill_ms", got[1], reprefill, "ms", fix, reveal, rel=1e-9)
