"""Random interleavings of the block pool's operations (truncation included), checked against a model of what each
block must hold.

The machine keeps a fake K/V store next to the pool: the value of a slot is a function of the whole token history
up to that position (real K/V depend on every earlier token). It applies the pool's copy-on-write copies and
writes new tokens through the block tables, so a block shared when it should not be, a copy that was skipped, or
a prefix hit on the wrong blocks shows up as a slot whose value does not match its sequence's history.
"""

from __future__ import annotations

import itertools
from collections import Counter
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlab.cache.storage.block_pool import BlockPool, PoolExhaustedError

N_BLOCKS, BLOCK_SIZE = 10, 2
# Two token values and two-token blocks make prefix hits (and, with the weak hash, collisions) common.
token_lists = st.lists(st.integers(0, 1), max_size=7)


def slot_value(history: list[int]) -> int:
    """The fake K/V of the last token of ``history``."""
    return hash(tuple(history))


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N_BLOCKS, BLOCK_SIZE)
        self.store: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(N_BLOCKS)]
        self.history: dict[int, list[int]] = {}  # live sequence -> its tokens (unknown ones as unique negatives)
        self.freed: list[int] = []
        self.unknown = itertools.count(-1, -1)

    def snapshot(self) -> tuple:
        pool = self.pool
        return (
            {s: (pool.block_table(s), pool.length(s)) for s in pool.sequences()},
            [pool.ref_count(b) for b in range(N_BLOCKS)],
            pool.free_blocks(),
            pool.n_cached,
        )

    def append(self, seqs: list[int], new: list[list[int]], known: bool, preempt: bool) -> None:
        before = self.snapshot()
        token_ids = new if known else None
        try:
            grant = self.pool.append(seqs, len(new[0]), token_ids, preempt=preempt)
        except PoolExhaustedError:
            assert self.snapshot() == before
            return
        for src, dst in grant.copies:
            self.store[dst] = list(self.store[src])
        for victim in grant.preempted:
            assert victim not in seqs
            del self.history[victim]
            self.freed.append(victim)
        for seq, tokens in zip(seqs, new, strict=True):
            table, history = self.pool.block_table(seq), self.history[seq]
            for token in tokens:
                history.append(token)
                position = len(history) - 1
                self.store[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = slot_value(history)

    @rule(prompt=token_lists, preempt=st.booleans())
    def add_with_prefix_hit(self, prompt: list[int], preempt: bool) -> None:
        seq, n_cached = self.pool.add_sequence(prompt)
        assert n_cached % BLOCK_SIZE == 0 and n_cached <= len(prompt)
        self.history[seq] = prompt[:n_cached]  # the invariant below checks the hit blocks hold this prefix's K/V
        self.check_contents()
        if n_cached < len(prompt):
            self.append([seq], [prompt[n_cached:]], known=True, preempt=preempt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), n=st.integers(1, 3), known=st.booleans(), preempt=st.booleans())
    def append_tokens(self, data: st.DataObject, n: int, known: bool, preempt: bool) -> None:
        live = sorted(self.history)
        seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True))
        if known:
            new = [data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) for _ in seqs]
        else:
            new = [[next(self.unknown) for _ in range(n)] for _ in seqs]
        self.append(seqs, new, known, preempt)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.history)))
        self.history[self.pool.fork(parent)] = list(self.history[parent])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_seq(data.draw(st.sampled_from(sorted(self.history))))

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Speculative decoding's rollback: later appends rewrite the forgotten slots, so no block that still
        answers prefix lookups may be among those rewritten in place."""
        seq = data.draw(st.sampled_from(sorted(self.history)))
        length = data.draw(st.integers(0, len(self.history[seq])))
        self.pool.truncate(seq, length)
        del self.history[seq][length:]

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_twice_raises(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.freed))
        before = self.snapshot()
        with pytest.raises(ValueError, match="not a live sequence"):
            self.pool.free(seq)
        assert self.snapshot() == before

    @rule()
    def free_all_leaves_every_block_free(self) -> None:
        for seq in list(self.history):
            self.free_seq(seq)
        assert self.pool.n_free == N_BLOCKS
        assert all(self.pool.ref_count(b) == 0 for b in range(N_BLOCKS))

    def free_seq(self, seq: int) -> None:
        self.pool.free(seq)
        del self.history[seq]
        self.freed.append(seq)

    @invariant()
    def refcounts_match_the_tables(self) -> None:
        held = Counter(b for s in self.pool.sequences() for b in self.pool.block_table(s))
        assert [self.pool.ref_count(b) for b in range(N_BLOCKS)] == [held[b] for b in range(N_BLOCKS)]
        assert sorted(self.pool.sequences()) == sorted(self.history)

    @invariant()
    def every_block_is_either_free_or_held(self) -> None:
        free = self.pool.free_blocks()
        assert len(free) == len(set(free))
        held = {b for s in self.pool.sequences() for b in self.pool.block_table(s)}
        assert not held & set(free)
        assert held | set(free) == set(range(N_BLOCKS))  # nothing leaks

    @invariant()
    def check_contents(self) -> None:
        for seq, history in self.history.items():
            table = self.pool.block_table(seq)
            assert self.pool.length(seq) == len(history)
            assert len(table) == -(-len(history) // BLOCK_SIZE)
            for position in range(len(history)):
                got = self.store[table[position // BLOCK_SIZE]][position % BLOCK_SIZE]
                assert got == slot_value(history[: position + 1]), f"seq {seq} position {position}"


class WeakHashMachine(BlockPoolMachine):
    """The same, with a hash that collides all the time: a collision may cost a hit, never return wrong K/V."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = mock.patch(
            "kvlab.cache.storage.block_pool.chain_hash", lambda parent_hash, tokens: sum(tokens) % 2
        )
        self.patch.start()

    def teardown(self) -> None:
        self.patch.stop()


SETTINGS = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = SETTINGS
TestBlockPoolWeakHash = WeakHashMachine.TestCase
TestBlockPoolWeakHash.settings = SETTINGS
