"""A multi-turn chat whose context grows every turn, and the two ways chat apps keep it bounded: cap and compaction.

A ``ChatSession`` keeps a system prompt and the turns that follow (a user message, then a reply) in one KV cache.
A turn prefills the user message and writes each reply token with one decode step, so the bytes each step reads
grow with the conversation (``kv_bytes_read`` sums them).

- ``cap``: before a turn would take the context past ``cap`` tokens, drop the oldest turns. The system prompt (and
  a summary, if there is one) always stays.
- ``compact(summary)``: replace the old turns with a summary, token ids written by someone (often the model).

Neither can edit the cache in place. Dropping a turn moves every later token to a new position, and every later
token's K/V was computed with the dropped turn in its context. So both rebuild: reset the cache and prefill what is
kept, again. That re-prefill is what the bytes saved on every later step must pay back, and each ``Rebuild``
records it: tokens re-prefilled, K/V bytes written, measured seconds, and the leading tokens that did not change
(a prefix cache, lesson 05, could have kept their K/V instead of recomputing them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.cache.base import CacheFactory, KVCache
from kvlab.machine.timing import time_call
from kvlab.model.decoder import Decoder
from kvlab.spec.validation import require_int


@dataclass(frozen=True)
class Turn:
    user: tuple[int, ...]
    reply: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.user + self.reply


@dataclass(frozen=True)
class Rebuild:
    """What one rebuild of the cache cost, and what it saves on each later decode step.

    ``context_before``/``context_after``: tokens in the cache before and after; all of ``context_after`` was
    re-prefilled. ``reusable_prefix``: leading tokens identical before and after (a prefix cache could have
    kept them). ``kv_bytes_written``: K/V the re-prefill wrote. ``kv_bytes_saved_per_step``: how much less a
    decode step reads now. ``seconds``: wall time of the re-prefill, measured.
    """

    reason: str
    turns_dropped: int
    context_before: int
    context_after: int
    reusable_prefix: int
    kv_bytes_written: int
    kv_bytes_saved_per_step: int
    seconds: float

    @property
    def tokens_reprefilled(self) -> int:
        return self.context_after

    def break_even_steps(self, bandwidth_gbps: float) -> float:
        """Decode steps after which the bytes saved, streamed at ``bandwidth_gbps``, repay the measured re-prefill.

        ``inf`` when a step saves nothing (a window cache that already read a bounded amount, for instance).
        """
        if not bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps: {bandwidth_gbps!r}; allowed: a number of GB/s > 0")
        if self.kv_bytes_saved_per_step <= 0:
            return math.inf
        return self.seconds / (self.kv_bytes_saved_per_step / (bandwidth_gbps * 1e9))


class ChatSession:
    """One conversation (batch 1) through ``model``, in a cache from ``make_cache(model, 1, capacity)``.

    ``capacity`` defaults to ``cap``, or to the model's ``max_seq_len`` without a cap. ``logits`` holds the
    next-token logits after the last token fed (``[V]``), or ``None`` before any.
    """

    def __init__(
        self,
        model: Decoder,
        system: Sequence[int],
        cap: int | None = None,
        make_cache: CacheFactory | None = None,
        capacity: int | None = None,
    ) -> None:
        self.model = model
        self.system = _token_ids("system", system, model, allow_empty=True)
        system = f"above the system prompt's {len(self.system)} tokens"
        require_int("cap", cap, len(self.system) + 1, note=system, or_none=True)
        self.cap = cap
        capacity = capacity or cap or model.cfg.max_seq_len
        self.cache = (make_cache or _new_cache)(model, 1, capacity)
        self.summary: tuple[int, ...] = ()
        self.turns: list[Turn] = []
        self.rebuilds: list[Rebuild] = []
        self.logits: torch.Tensor | None = None
        self.prefill_tokens = 0  # system prompt and user messages, as they arrived (rebuilds are in ``rebuilds``)
        self.decode_steps = 0
        self.kv_bytes_read = 0  # summed over decode steps
        self._prefill(self.system)

    @property
    def context(self) -> list[int]:
        """The tokens in the cache, in order: system prompt, summary, kept turns."""
        return [*self.system, *self.summary, *(t for turn in self.turns for t in turn.tokens)]

    @property
    def reprefill_tokens(self) -> int:
        return sum(r.tokens_reprefilled for r in self.rebuilds)

    def turn(self, user: Sequence[int], reply: int | Sequence[int]) -> list[int]:
        """Prefill ``user``, then write the reply one decode step per token; return the reply's ids.

        ``reply``: the reply's token ids (a scripted conversation), or how many tokens to generate greedily.
        With a cap, the oldest turns go first, so that the context stays within the cap to the end of the turn.
        """
        user = _token_ids("user", user, self.model)
        if isinstance(reply, int) and not isinstance(reply, bool):
            require_int("reply", reply, 0, note="a number of tokens to generate; or give the reply's token ids")
            scripted, n_reply = None, reply
        else:
            scripted = _token_ids("reply", reply, self.model, allow_empty=True)
            n_reply = len(scripted)
        if self.cap is not None:
            self._apply_cap(len(user) + n_reply)
        logits = self._prefill(user)
        out = []
        for i in range(n_reply):
            token = int(logits.argmax()) if scripted is None else scripted[i]
            out.append(token)
            logits = self.model.decode_step(torch.tensor([token], device=self.model.device), self.cache)[0]
            self.decode_steps += 1
            self.kv_bytes_read += self.cache.bytes_read_per_step()
        self.turns.append(Turn(user, tuple(out)))
        self.logits = logits
        return out

    def compact(self, summary: Sequence[int], keep_last_turns: int = 0) -> Rebuild:
        """Replace every turn but the last ``keep_last_turns`` (and any earlier summary) with ``summary``."""
        summary = _token_ids("summary", summary, self.model, allow_empty=True)
        n_turns = len(self.turns)
        require_int("keep_last_turns", keep_last_turns, 0, n_turns, note="the session's turns")
        kept = self.turns[n_turns - keep_last_turns :]
        n_after = len(self.system) + len(summary) + sum(len(t.tokens) for t in kept)
        if self.cap is not None and n_after > self.cap:
            raise ValueError(
                f"summary: {len(summary)} tokens take the context to {n_after}, past cap={self.cap}; "
                "allowed: a shorter summary, or fewer kept turns"
            )
        before = self.context
        self.summary, self.turns = summary, kept
        return self._rebuild("compaction", n_turns - keep_last_turns, before)

    def _apply_cap(self, incoming: int) -> None:
        pinned = len(self.system) + len(self.summary)
        before = self.context
        n_drop = turns_to_drop(pinned, [len(t.tokens) for t in self.turns], incoming, self.cap)
        if n_drop:
            self.turns = self.turns[n_drop:]
            self._rebuild("cap", n_drop, before)

    def _rebuild(self, reason: str, turns_dropped: int, before: list[int]) -> Rebuild:
        after = self.context
        self.cache.reset()
        (seconds,) = time_call(lambda: self._prefill(after, count=False), 1, warmup=0, device=self.model.device)
        reusable = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after))
        )
        rebuild = Rebuild(
            reason=reason,
            turns_dropped=turns_dropped,
            context_before=len(before),
            context_after=len(after),
            reusable_prefix=reusable,
            kv_bytes_written=round(len(after) * self.cache.bytes_per_token),
            kv_bytes_saved_per_step=self.cache.bytes_read_per_step(len(before)) - self.cache.bytes_read_per_step(),
            seconds=seconds,
        )
        self.rebuilds.append(rebuild)
        return rebuild

    def _prefill(self, tokens: Sequence[int], count: bool = True) -> torch.Tensor | None:
        """Feed ``tokens`` in one prefill; return (and keep) the logits after the last one."""
        if not tokens:
            self.logits = None
            return None
        batch = torch.tensor([list(tokens)], device=self.model.device)
        self.logits = self.model.prefill(batch, self.cache)[0, -1]
        if count:
            self.prefill_tokens += len(tokens)
        return self.logits


def turns_to_drop(pinned: int, turns: Sequence[int], incoming: int, cap: int) -> int:
    """The cap's rule: how many of the oldest ``turns`` (their lengths, oldest first) must go so that the ``pinned``
    tokens (system prompt, summary), the turns kept and the ``incoming`` turn fit in ``cap`` tokens."""
    if pinned + incoming > cap:
        raise ValueError(
            f"cap: {cap} tokens cannot hold the pinned {pinned} (system prompt, summary) plus this turn ({incoming}); "
            f"allowed: a cap >= {pinned + incoming}, or a shorter turn"
        )
    n_drop, total = 0, pinned + sum(turns)
    while total + incoming > cap:
        total -= turns[n_drop]
        n_drop += 1
    return n_drop


def _new_cache(model: Decoder, batch_size: int, capacity: int) -> KVCache:
    return model.new_cache(batch_size, capacity=capacity)


def _token_ids(name: str, ids: Sequence[int], model: Decoder, allow_empty: bool = False) -> tuple[int, ...]:
    """``ids`` as a tuple of ints, each a valid token id; raise ``ValueError`` naming ``name`` otherwise."""
    vocab = model.cfg.vocab_size
    ids = tuple(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
    if (not ids and not allow_empty) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids
    ):
        least = "zero or more" if allow_empty else "one or more"
        raise ValueError(f"{name}: {ids!r} is not allowed; allowed: {least} token ids in 0 .. {vocab - 1}")
    return ids
