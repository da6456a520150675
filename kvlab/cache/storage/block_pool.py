"""A pool of fixed-size KV blocks: per-sequence block tables, refcounts, copy-on-write forks and prefix caching.

The pool only does the bookkeeping; the K/V tensors live with the cache that owns the pool (see ``paged.py``).
Block ids index those tensors, and ``append`` tells the owner which blocks to copy before it writes.

Prefix caching: once a block is full and all its token ids are known, it is registered under a chained hash,
``chain_hash(parent_hash, tokens)``, so a block stands for its whole prefix, not just its own tokens (its K/V
depend on every earlier token). A hit is verified against the stored token ids and the parent's registration,
so a hash collision can only cost a miss, never return another prefix's K/V. A freed block that is registered
stays in the pool as reusable cache until an allocation needs it; allocations take never-cached blocks first,
then evict cached ones least recently used first.

Holes: a sliding window returns the blocks a sequence will never read again to the pool (``release_block``); the
table keeps their index as ``HOLE``, so table index ``i`` still holds positions ``i * block_size ..``. A hole is
never read, forked, copied or released again.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlab.cache.base import CacheCapacityError
from kvlab.spec.validation import require_int

# A table entry that holds no block: a released one (a window's hole), or the padding of a shorter row in a batch's
# table tensor. Not a block id, so an index that reached it would raise.
HOLE = -1


class PoolExhaustedError(CacheCapacityError):
    """Raised, before anything changes, when an append needs more free blocks than the pool has."""


def int_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    """``token_ids`` as a tuple of Python ints, the form hashes and registrations compare. A tuple of ints (what
    ``kvlab.engine.engine.Request`` holds) is returned as it is: checking costs a C-level pass, converting a Python one,
    and a 30k-token chat prompt is checked several times a turn."""
    if type(token_ids) is tuple and set(map(type, token_ids)) <= {int}:
        return token_ids
    return tuple(map(int, token_ids))


def chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of one full block given its parent's hash: equal hashes mean (barring collisions) equal prefixes."""
    return hash((parent_hash, tokens))


def shared_prefix_blocks(tables: Sequence[Sequence[int]]) -> int:
    """How many leading entries all block tables have in common (the blocks a cascade step reads once)."""
    if not tables:
        return 0
    n = min(len(t) for t in tables)
    first = tables[0]
    for i in range(n):
        if any(t[i] != first[i] for t in tables):
            return i
    return n


@dataclass(frozen=True)
class _Entry:
    """What a registered block holds, to verify a hash hit: its tokens and which registration is its parent."""

    key: int
    tokens: tuple[int, ...]
    parent_serial: int | None
    serial: int  # unique per registration, so a child never matches a parent block that was evicted and reused


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    tail: list[int] | None = field(default_factory=list)  # known ids in the unfilled last block; None: unknown
    last_hash: int | None = None  # chain hash and serial of the last full block, parent of the next one
    last_serial: int | None = None


@dataclass(frozen=True)
class Grant:
    """What an ``append`` did: ``copies`` are ``(src, dst)`` blocks to copy before writing (copy-on-write);
    ``preempted`` are the sequences freed to make room."""

    copies: list[tuple[int, int]]
    preempted: list[int]


class BlockPool:
    """``n_blocks`` blocks of ``block_size`` token slots, shared by sequences through block tables."""

    def __init__(self, n_blocks: int, block_size: int) -> None:
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            require_int(name, value)
        self.n_blocks, self.block_size = n_blocks, block_size
        self._ref = [0] * n_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))  # front is evicted first
        self._entries: dict[int, _Entry] = {}  # block -> registration
        self._by_hash: dict[int, int] = {}  # chain hash -> block
        self._seqs: dict[int, _Seq] = {}  # insertion order is admission order (the preemption rule uses it)
        self._ids = itertools.count()
        self._serials = itertools.count()

    # -- queries ----------------------------------------------------------------------------------------------
    def sequences(self) -> list[int]:
        return list(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).blocks)

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def free_blocks(self) -> list[int]:
        """Free blocks in the order allocations take them: never-cached first, then cached ones, LRU first."""
        return list(self._free)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_cached(self) -> int:
        """Registered blocks, referenced or free."""
        return len(self._entries)

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the K/V of ``token_ids``' leading full blocks, as far as the cache has them."""
        ids = int_tuple(token_ids)
        blocks, parent_hash, parent_serial = [], None, None
        for i in range(len(ids) // self.block_size):
            chunk = ids[i * self.block_size : (i + 1) * self.block_size]
            key = chain_hash(parent_hash, chunk)
            entry = self._entries.get(self._by_hash.get(key, -1))
            if entry is None or entry.tokens != chunk or entry.parent_serial != parent_serial:
                break
            blocks.append(self._by_hash[key])
            parent_hash, parent_serial = key, entry.serial
        return blocks

    # -- sequences --------------------------------------------------------------------------------------------
    def add_sequence(self, token_ids: Sequence[int] = (), max_cached_tokens: int | None = None) -> tuple[int, int]:
        """Start a sequence that shares the cached blocks of ``token_ids``' leading full blocks (at most
        ``max_cached_tokens`` tokens of them). Returns ``(seq_id, n_cached_tokens)``; the sequence holds those
        tokens, and the caller appends the rest of ``token_ids`` (computing their K/V) with ``append``."""
        require_int("max_cached_tokens", max_cached_tokens, 0, or_none=True)
        hits = self.cached_prefix(token_ids)
        if max_cached_tokens is not None:
            hits = hits[: max_cached_tokens // self.block_size]
        seq = _Seq(blocks=hits, length=len(hits) * self.block_size)
        for block in hits:
            self._free.pop(block, None)
            self._ref[block] += 1
        if hits:
            last = self._entries[hits[-1]]
            seq.last_hash, seq.last_serial = last.key, last.serial
        seq_id = next(self._ids)
        self._seqs[seq_id] = seq
        return seq_id, seq.length

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block of ``seq_id``; a shared block is copied only when one writes to it."""
        parent = self._seq(seq_id)
        for block in _held(parent.blocks):
            self._ref[block] += 1
        child_id = next(self._ids)
        tail = None if parent.tail is None else list(parent.tail)
        self._seqs[child_id] = _Seq(list(parent.blocks), parent.length, tail, parent.last_hash, parent.last_serial)
        return child_id

    def free(self, seq_id: int) -> None:
        """Drop a sequence. Its registered blocks stay cached; tail blocks go first, so its prefix outlives them."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for block in reversed(_held(seq.blocks)):
            self._release(block)

    def truncate(self, seq_id: int, length: int) -> None:
        """Shorten a sequence to its first ``length`` tokens (speculative decoding's rollback).

        Blocks past the new end go back to the pool. A registered block that the sequence will now write into
        again stays registered only while others hold it (the next write copies it first); held by this sequence
        alone, it is unregistered, since its slots are about to change. The chain (hash, serial and the known ids
        of the new last block) is rebuilt from the kept blocks' registrations, so later blocks can still be cached.
        """
        seq = self._seq(seq_id)
        require_int("length", length, 0, seq.length)
        keep = math.ceil(length / self.block_size)
        if HOLE in seq.blocks[:keep]:  # the tokens of a released block are gone: no length past it comes back
            first_hole = seq.blocks.index(HOLE)
            raise ValueError(
                f"length: {length}; allowed: at most {first_hole * self.block_size} (blocks past it were released)"
            )
        for block in reversed(_held(seq.blocks[keep:])):
            self._release(block)
        del seq.blocks[keep:]
        n_full, partial = divmod(length, self.block_size)
        tail_block = seq.blocks[n_full] if partial else None
        if partial and seq.length < (n_full + 1) * self.block_size:  # the same block, never filled or sealed
            tail = None if seq.tail is None else seq.tail[:partial]
        elif tail_block in self._entries:  # a full, registered block: its registration knows its ids
            tail = list(self._entries[tail_block].tokens[:partial])
        else:
            tail = [] if not partial else None
        if tail_block in self._entries and self._ref[tail_block] == 1:
            self._unregister(tail_block)
        parent = self._entries.get(seq.blocks[n_full - 1]) if n_full else None
        if n_full and parent is None:
            tail = None  # the kept prefix has an unregistered full block: no later block can join the chain
        seq.length, seq.tail = length, tail
        seq.last_hash, seq.last_serial = (parent.key, parent.serial) if parent else (None, None)

    def append(
        self,
        seq_ids: Sequence[int],
        n_tokens: int,
        token_ids: Sequence[Sequence[int]] | None = None,
        preempt: bool = False,
    ) -> Grant:
        """Grow each of ``seq_ids`` by ``n_tokens`` slots. ``token_ids`` (``[len(seq_ids)][n_tokens]``, or None
        when unknown) let the blocks these tokens fill be registered for prefix caching.

        When the free blocks do not suffice: with ``preempt=False`` raise ``PoolExhaustedError``; with
        ``preempt=True`` free other sequences, most recently added first (they have the least work to redo, and
        earlier requests keep their place), until it fits. When it cannot fit, nothing changes.
        """
        require_int("n_tokens", n_tokens, 1)
        if not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: {list(seq_ids)}; allowed: one or more distinct live sequence ids")
        seqs = [self._seq(s) for s in seq_ids]
        if token_ids is not None and [len(t) for t in token_ids] != [n_tokens] * len(seqs):
            raise ValueError(f"token_ids: allowed None, or {len(seqs)} lists of {n_tokens} token ids each")
        victims = self._plan_preemption(seq_ids, n_tokens, preempt)
        for victim in victims:
            self.free(victim)
        copies = []
        for i, seq in enumerate(seqs):
            shared = seq.blocks[-1] if seq.length % self.block_size else None
            if shared is not None and self._ref[shared] > 1:  # about to write into a block others hold
                self._ref[shared] -= 1
                seq.blocks[-1] = self._take()
                copies.append((shared, seq.blocks[-1]))
            self._grow(seq, n_tokens, None if token_ids is None else token_ids[i])
        return Grant(copies, victims)

    def release_block(self, seq_id: int, index: int) -> None:
        """Give back entry ``index`` of a sequence's table (a sliding window no longer reads it): the entry becomes
        a ``HOLE``. The block returns to the pool once no other sequence holds it; a registered one then stays
        cached (a later prompt with the same prefix may still hit it) until an allocation evicts it. A partly filled
        last block stays: the next step writes into it."""
        seq = self._seq(seq_id)
        n_full = len(seq.blocks) - (seq.length % self.block_size > 0)  # a partly filled last block is written
        require_int("index", index, 0, n_full - 1, note="a full block's entry")
        if seq.blocks[index] != HOLE:
            self._release(seq.blocks[index])
            seq.blocks[index] = HOLE

    def release_gone(self, seq_id: int, indices: range) -> bool:
        """Give back the entries ``indices`` of a sequence's table that a sliding window has passed, newest first,
        stopping at the first hole: the older ones went back on earlier steps, unless the sequence began with
        prefix hits, whose blocks this walk then gives back too. Whether any went back."""
        blocks, released = self._seq(seq_id).blocks, False
        for index in reversed(indices):
            if blocks[index] == HOLE:
                break
            self.release_block(seq_id, index)
            released = True
        return released

    # -- internals --------------------------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> _Seq:
        if seq_id not in self._seqs:
            raise ValueError(
                f"seq_id: {seq_id!r} is not a live sequence (never added, or already freed); "
                f"allowed: one of {sorted(self._seqs)}"
            )
        return self._seqs[seq_id]

    def _blocks_needed(self, seq_ids: Sequence[int], n_tokens: int, ref: list[int]) -> int:
        """Free blocks an append needs, given refcounts ``ref``: new blocks plus copy-on-write copies."""
        need, writers = 0, Counter()
        for seq in (self._seqs[s] for s in seq_ids):
            need += math.ceil((seq.length + n_tokens) / self.block_size) - len(seq.blocks)
            if seq.length % self.block_size:
                writers[seq.blocks[-1]] += 1
        # Every writer of a shared block copies it, except the last when no one but the writers holds it.
        return need + sum(k - (ref[b] == k) for b, k in writers.items() if ref[b] > 1)

    def _plan_preemption(self, seq_ids: Sequence[int], n_tokens: int, preempt: bool) -> list[int]:
        """The victims an append needs (none if it fits), worked out on a copy of the refcounts."""
        ref, n_free, victims = list(self._ref), len(self._free), []
        candidates = [s for s in reversed(self._seqs) if s not in seq_ids] if preempt else []
        while n_free < self._blocks_needed(seq_ids, n_tokens, ref):
            if not candidates:
                need = self._blocks_needed(seq_ids, n_tokens, self._ref)
                raise PoolExhaustedError(
                    f"block pool exhausted: adding {n_tokens} token(s) to {len(seq_ids)} sequence(s) needs {need} "
                    f"free block(s) of {self.block_size} tokens, but {self.n_free} of {self.n_blocks} are free"
                    f"{' even after preempting every other sequence' if preempt else ''}. Free finished sequences, "
                    "pass preempt=True, or build the pool with more blocks."
                )
            victims.append(candidates.pop(0))
            for block in _held(self._seqs[victims[-1]].blocks):
                ref[block] -= 1
                n_free += ref[block] == 0
        return victims

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None
            if block not in self._entries:  # worthless once free: reuse it before any cached block
                self._free.move_to_end(block, last=False)

    def _take(self, after: int = HOLE) -> int:
        """A free block with refcount 1: the block after ``after`` when it is free and caches nothing, so that a
        sequence's blocks stay one run that a step reads in place; else the front of the free list (never-cached
        blocks first, then cached ones, LRU first: the one taken is evicted)."""
        if after != HOLE and after + 1 in self._free and after + 1 not in self._entries:
            block = after + 1
            del self._free[block]
        elif (start := self._room_to_grow()) is not None:
            block = start
            del self._free[block]
        else:
            block, _ = self._free.popitem(last=False)
        if block in self._entries:
            self._unregister(block)
        self._ref[block] = 1
        return block

    def _room_to_grow(self) -> int | None:
        """The block that starts a new run where it can grow furthest: in the longest run of free blocks that cache
        nothing, its first block, or its middle when the block before it is held or cached (the sequence that holds
        it, or the next turn that hits its prefix, grows into the first half). ``None`` when every free block caches
        something."""
        empty = sorted(b for b in self._free if b not in self._entries)
        if not empty:
            return None
        best_start, best_len, start = empty[0], 1, empty[0]
        for prev, b in zip(empty, empty[1:], strict=False):
            if b != prev + 1:
                start = b
            if b - start + 1 > best_len:
                best_start, best_len = start, b - start + 1
        before = best_start - 1
        in_use = before >= 0 and (self._ref[before] > 0 or before in self._entries)
        return best_start + best_len // 2 if in_use else best_start

    def _unregister(self, block: int) -> None:
        del self._by_hash[self._entries.pop(block).key]
        if block in self._free:
            self._free.move_to_end(block, last=False)

    def _grow(self, seq: _Seq, n_tokens: int, token_ids: Sequence[int] | None) -> None:
        first = seq.length
        seq.length += n_tokens
        for _ in range(math.ceil(seq.length / self.block_size) - len(seq.blocks)):
            seq.blocks.append(self._take(seq.blocks[-1] if seq.blocks else HOLE))
        if token_ids is None:
            seq.tail = None  # every later block's prefix holds an unknown token: none of them can be cached
            return
        for filled, token in enumerate(token_ids, start=first + 1):
            if seq.tail is None:
                return
            seq.tail.append(int(token))
            if filled % self.block_size == 0:
                self._seal(seq, seq.blocks[filled // self.block_size - 1])

    def _seal(self, seq: _Seq, block: int) -> None:
        """Register ``seq``'s block that just filled, unless the same prefix is already cached elsewhere."""
        tokens = tuple(seq.tail)
        key = chain_hash(seq.last_hash, tokens)
        entry = self._entries.get(self._by_hash.get(key, -1))
        if entry is None or entry.tokens != tokens or entry.parent_serial != seq.last_serial:
            # A new prefix, or a collision or stale registration under this hash: the newest content takes it.
            if entry is not None:
                self._unregister(self._by_hash[key])
            entry = _Entry(key, tokens, seq.last_serial, next(self._serials))
            self._entries[block] = entry
            self._by_hash[key] = block
        seq.last_hash, seq.last_serial, seq.tail = key, entry.serial, []


def _held(blocks: list[int]) -> list[int]:
    """A table's block ids without its holes."""
    return [b for b in blocks if b != HOLE]
