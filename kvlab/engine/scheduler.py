"""The engine's scheduler: it plans each step against a ``BlockPool`` alone, in integers (no model, no tensors).

A plan (``StepPlan``) is the step's pool operations in the order the scheduler made them: admissions (``Admit``:
a new pool sequence and its prefix hits), frees (``Free``: a preempted, finished or cancelled request), and model
calls (``ScheduledCall``: which pool sequences, the token ids each stores, how many each has cached, which rows
sample a token after it). The pool already reflects the plan when ``schedule`` returns; a runner replays it on a
paged cache to compute the tokens, and a simulated run needs nothing but the plan's calls.

The rules (``kvlab.engine.engine``'s docstring gives the step): admission oldest first while the pool, less what
the admitted prefills will still take, holds the prompt's uncached blocks and one decode; one decode call, then
prefill chunks under ``token_budget``; before a call stores tokens, preemption by recompute, newest first, until
the pool holds the blocks the call needs; with a window, a sequence's blocks that no query of the call can see go
back to the pool before it stores. A request whose last token a call samples (its ``max_new_tokens``th) gives its
blocks back right after that call; one that samples a stop token, when ``record`` learns it, after the step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.spec.keep import SinksAndWindow, blocks_inside
from kvlab.spec.validation import require_bool, require_int

if TYPE_CHECKING:
    from kvlab.cache.storage.block_pool import BlockPool
    from kvlab.engine.request import RequestHandle


@dataclass(frozen=True)
class ModelCall:
    """One forward a step runs, as a clock charges it: per row, ``(new tokens, tokens already cached)``."""

    rows: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ScheduledCall(ModelCall):
    """A model call of a plan: rows are pool sequences ``seq_ids``, each storing ``tokens[i]`` (one token per row
    for a ``decode`` call over a ragged batch; one row's chunk for a prefill); ``samples`` are the requests whose
    next token the call's last logits give, in row order."""

    seq_ids: tuple[int, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    samples: tuple[RequestHandle, ...] = ()
    decode: bool = False


@dataclass(frozen=True)
class Admit:
    """A pool sequence the scheduler added, from ``token_ids`` (empty without prefix caching), ``n_cached`` of them
    prefix hits."""

    seq_id: int
    token_ids: tuple[int, ...]
    n_cached: int


@dataclass(frozen=True)
class Free:
    seq_id: int


@dataclass
class StepPlan:
    """One step: ``ops`` in the order they changed the pool; ``preempted`` the requests sent back to wait."""

    ops: list[Admit | Free | ScheduledCall] = field(default_factory=list)
    preempted: list[RequestHandle] = field(default_factory=list)

    @property
    def calls(self) -> list[ScheduledCall]:
        return [op for op in self.ops if isinstance(op, ScheduledCall)]

    @property
    def samples(self) -> list[RequestHandle]:
        """The requests that get a token this step, in the order the calls sample them."""
        return [x for call in self.calls for x in call.samples]


class Scheduler:
    """Waiting and running requests over ``pool``, a ``BlockPool`` it alone changes (module docstring).

    ``max_batch``, ``token_budget``, ``prefix_caching``, ``window`` and ``sinks`` as ``Engine`` takes them. Counters
    since ``reset``: ``prefix_hit_tokens``, ``preemptions``, ``max_running``, ``peak_blocks``.
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_batch: int = 8,
        token_budget: int = 512,
        prefix_caching: bool = True,
        window: int | None = None,
        sinks: int = 0,
    ) -> None:
        require_int("max_batch", max_batch)
        require_int("token_budget", token_budget)
        require_bool("prefix_caching", prefix_caching)
        self.pool = pool
        self.max_batch, self.token_budget, self.prefix_caching = max_batch, token_budget, prefix_caching
        self.keep = SinksAndWindow(window, sinks)  # the rule PagedKVCache and the byte model apply too
        self.waiting: deque[RequestHandle] = deque()  # preempted requests wait at the front
        self.running: list[RequestHandle] = []  # admission order: the last is the newest, preempted first
        self._ops: list[Admit | Free | ScheduledCall] = []  # frees made between steps, the next plan's first ops
        self.reset()

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def reset(self) -> None:
        """Drop every request and zero the counters (cached prefix blocks stay)."""
        self.release()
        self.waiting.clear()
        self.prefix_hit_tokens = self.preemptions = self.max_running = self.peak_blocks = 0

    def release(self) -> None:
        """Give back every running request's blocks (after an error from the model too: none may stay held)."""
        for x in self.running:
            self._free(x.seq_id, self._ops)
            x.seq_id, x.todo = None, ()
        self.running.clear()

    def reject(self, x: RequestHandle) -> str | None:
        """Why the pool cannot serve ``x`` even alone (None if it can)."""
        room = self.pool.n_blocks * self.block_size
        if x.final_length <= room:
            return None
        return (
            f"prompt_ids, max_new_tokens: {len(x.request.prompt_ids)} prompt tokens + max_new_tokens="
            f"{x.request.max_new_tokens} need {x.final_length} cached tokens; allowed: at most the whole pool, "
            f"n_blocks x block_size = {self.pool.n_blocks} x {self.block_size} = {room}"
        )

    def cancel(self, x: RequestHandle) -> None:
        """Drop a waiting or running request; a running one's blocks go back now."""
        if x in self.waiting:
            self.waiting.remove(x)
        elif x in self.running:
            self._free(x.seq_id, self._ops)
            self.running.remove(x)
            x.seq_id, x.todo = None, ()

    # -- a step ------------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Admit what fits, plan one decode call and the prefill chunks; the pool reflects the plan on return."""
        plan, self._ops = StepPlan(self._ops), []
        self._admit(plan)
        self.max_running = max(self.max_running, len(self.running))
        decoding = [x for x in self.running if not x.todo]
        if decoding:
            self._decode(decoding, plan)
        budget = self.token_budget - sum(n for call in plan.calls for n, _ in call.rows)
        for x in [x for x in self.running if x.todo]:
            if budget <= 0:
                break
            if x.seq_id is not None:  # not preempted by an earlier chunk of this step
                n = min(budget, len(x.todo))
                self._prefill(x, n, plan)
                budget -= n
        return plan

    def record(self, x: RequestHandle, token: int) -> bool:
        """``x`` sampled ``token``; whether that finished it (its blocks are then given back, if it still held any)."""
        x.output.append(token)
        if x.request.sampling is not None:
            x.stopped = token in x.request.sampling.stop_token_ids
        if not x.done:
            return False
        if x.seq_id is not None:  # a stop token: the plan could not know
            self.cancel(x)
        elif x in self.waiting:  # preempted after it sampled, in the same step
            self.waiting.remove(x)
        return True

    # -- planning ----------------------------------------------------------------------------------------------
    def _blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def _still_to_take(self, x: RequestHandle) -> int:
        """Blocks an admitted request's prefill and first decode will still take from the pool."""
        stored = self.pool.length(x.seq_id)
        target = min(stored + len(x.todo) + 1, x.final_length)
        return self._blocks_for(target) - len(self.pool.block_table(x.seq_id))

    def _admit(self, plan: StepPlan) -> None:
        pool = self.pool
        while self.waiting and len(self.running) < self.max_batch:
            x = self.waiting[0]
            tokens = x.tokens
            hits = pool.cached_prefix(tokens)[: (len(tokens) - 1) // self.block_size] if self.prefix_caching else []
            # Hit blocks that no sequence holds are in the free count, and admitting takes them out of it.
            idle_hits = sum(pool.ref_count(b) == 0 for b in hits)
            need = self._blocks_for(min(len(tokens) + 1, x.final_length)) - len(hits) + idle_hits
            promised = sum(self._still_to_take(r) for r in self.running if r.todo)
            if pool.n_free - promised < need:
                return
            self.waiting.popleft()
            ids = tokens if self.prefix_caching else ()
            # At most every whole block but the one holding the last token: a prefill must still yield its logits.
            x.seq_id, n_cached = pool.add_sequence(ids, max(len(ids) - 1, 0) // self.block_size * self.block_size)
            plan.ops.append(Admit(x.seq_id, ids, n_cached))
            x.todo = tokens[n_cached:]
            x.admitted = True
            self.prefix_hit_tokens += n_cached
            self.running.append(x)

    def _decode(self, rows: list[RequestHandle], plan: StepPlan) -> None:
        """Each row stores its last token and samples its next one, in one call."""
        size, pool = self.block_size, self.pool
        self._make_room(lambda: sum(pool.length(x.seq_id) % size == 0 for x in rows if x.seq_id is not None), plan)
        rows = [x for x in rows if x.seq_id is not None]
        if rows:
            self._call(rows, tuple((x.output[-1],) for x in rows), True, rows, plan)

    def _prefill(self, x: RequestHandle, n: int, plan: StepPlan) -> None:
        """The next ``n`` of ``x``'s tokens; if that ends them, ``x`` samples its next token."""
        start = self.pool.length(x.seq_id)
        self._make_room(
            lambda: 0 if x.seq_id is None else self._blocks_for(start + n) - len(self.pool.block_table(x.seq_id)),
            plan,
        )
        if x.seq_id is None:  # it was the newest: preempted to make room for itself
            return
        chunk, x.todo = tuple(x.todo[:n]), x.todo[n:]
        self._call([x], (chunk,), False, [] if x.todo else [x], plan)

    def _call(
        self,
        rows: list[RequestHandle],
        tokens: tuple[tuple[int, ...], ...],
        decode: bool,
        samples: list[RequestHandle],
        plan: StepPlan,
    ) -> None:
        """Store ``tokens`` in ``rows``' sequences (after the window's releases), as one call of the plan."""
        seq_ids = [x.seq_id for x in rows]
        cached = [self.pool.length(s) for s in seq_ids]
        self._release_evicted(seq_ids, plan)
        # The ids let full blocks be registered, so a later prompt (or this one, readmitted) hits them.
        self.pool.append(seq_ids, len(tokens[0]), tokens if self.prefix_caching else None)
        self.peak_blocks = max(self.peak_blocks, self.pool.n_blocks - self.pool.n_free)
        rows_nc = tuple((len(t), c) for t, c in zip(tokens, cached, strict=True))
        plan.ops.append(ScheduledCall(rows_nc, tuple(seq_ids), tokens, tuple(samples), decode))
        for x in samples:  # its last token: known now, so its blocks go back before the next call plans
            if len(x.output) + 1 == x.request.max_new_tokens:
                self._free(x.seq_id, plan.ops)
                self.running.remove(x)
                x.seq_id = None

    def _make_room(self, needed: Callable[[], int], plan: StepPlan) -> None:
        """Preempt the newest running requests until the pool holds ``needed()`` free blocks."""
        while self.pool.n_free < needed():
            victim = self.running.pop()
            self._free(victim.seq_id, plan.ops)
            victim.seq_id, victim.todo = None, ()
            victim.preemptions += 1
            self.preemptions += 1
            self.waiting.appendleft(victim)
            plan.preempted.append(victim)

    def _release_evicted(self, seq_ids: Sequence[int], plan: StepPlan) -> None:
        """With a window: give back each sequence's blocks that no query of the coming call sees (after the sinks'
        blocks, before the block holding the oldest token the first new query's window reaches). The first new
        token sits at the sequence's length."""
        if self.keep.window is None:
            return
        for seq_id in seq_ids:
            self.pool.release_gone(seq_id, blocks_inside(self.keep.gone(self.pool.length(seq_id)), self.block_size))

    def _free(self, seq_id: int, ops: list[Admit | Free | ScheduledCall]) -> None:
        self.pool.free(seq_id)
        ops.append(Free(seq_id))
