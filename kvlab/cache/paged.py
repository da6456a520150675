"""A paged KV cache: K/V live in fixed-size blocks of one pool, reached through per-sequence block tables.

Paging lets a server hold many sequences without reserving ``max_seq_len`` slots for each (lesson 04), lets
sequences and chat turns share the blocks of a common prefix (lesson 05), and lets a step read a prefix the
batch shares once (cascade attention, ``cascade=True``).

Layout: per layer, one key store and one value store (``kvlab.cache.stores``) with lead ``(Hkv,)`` and
``n_blocks x block_size`` slots; block ``b`` is slots ``b * block_size ..``. A block holds whatever the codec
stores (fp32 values, or int8 codes with their scales), so paging composes with every codec. Float keys are
key-major, ``[Hkv, D, n_blocks, block_size]`` as a tensor, as in the contiguous cache, so ``q @ K`` streams runs of
tokens. The block index sits inside the head and dim indices (GPU caches put it outermost) so that gathering a
sequence's blocks (``take_blocks``) lands directly in the ``[Hkv, D, S]`` layout ``decode_attention`` takes, in
one copy; block-outermost storage needs a second, strided copy to get there. A block id covers every layer, so
one table per sequence serves them all.

Reading: this reference gathers a sequence's blocks into scratch (decoding them, for fp8/int8/int4) and runs the
contiguous cache's kernel on it, so paged decode equals contiguous decode up to fp32 rounding (the same kernel,
over tensors of other sizes and strides, which a BLAS may block and sum in another order). A fused paged kernel
(vLLM's, FlashInfer's) reads the blocks in place; the gather is an extra copy that the byte counts leave out and
CPU timings pay for. A layer with a sliding window gathers only the blocks its window reaches.

Prefix hits: the cache can only hash blocks whose token ids it knows, and ``Decoder`` hands a cache no token ids.
``begin(prompts)`` tells it the prompts; ``feed_tokens`` tells it the tokens of the next steps (the sampled ones)::

    cache = PagedKVCache.for_model(model, n_blocks=256, block_size=16)
    n_cached = cache.begin([prompt])          # leading tokens whose K/V are already in the pool
    logits = model.prefill(torch.tensor([prompt[n_cached:]]), cache)[:, -1]
    token = logits.argmax(-1)
    cache.feed_tokens(token[:, None])         # optional: lets the response's blocks be cached for the next turn
    logits = model.decode_step(token, cache)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvlab.cache.base import CacheCapacityError, CacheShape, KVCache, Rotate, kv_codec, refuse_latent
from kvlab.cache.block_pool import BlockPool, shared_prefix_blocks
from kvlab.cache.stores import make_store
from kvlab.kernels import attend_slab, cascade_decode_attention, decode_attention
from kvlab.validation import require_int

TABLE_ENTRY_BYTES = 4  # block tables are int32, as in vLLM and FlashInfer


class PagedKVCache(KVCache):
    """``n_blocks`` blocks of ``block_size`` tokens, shared by a batch of sequences that advance together.

    ``n_blocks`` defaults to enough blocks for ``batch_size`` sequences of ``capacity`` tokens each. With
    ``n_blocks`` given, ``capacity`` may be ``None``: a sequence may then grow until the pool runs out (``capacity``
    reads as the whole pool, ``n_blocks x block_size``); with both given, ``capacity`` caps each sequence.
    ``codec`` (default: the dtype K/V arrive in) is any of ``kvlab.dtypes.KV_DTYPES``, ``group_size`` channels per
    scale for fp8/int8/int4.

    The batch starts as ``batch_size`` empty sequences; ``begin`` replaces it (with prefix hits), ``fork`` grows
    it, so ``batch_size`` follows the batch. ``reserve`` raises ``PoolExhaustedError`` (a ``CacheCapacityError``)
    before changing anything when the pool is short. With ``cascade=True``, a decode step reads the blocks every
    sequence shares once.
    """

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        block_size: int = 16,
        n_blocks: int | None = None,
        cascade: bool = False,
        codec: str | None = None,
        group_size: int = 32,
    ) -> None:
        super().__init__(shape, batch_size, capacity)
        require_int("block_size", block_size)
        if n_blocks is None:
            if capacity is None:
                raise ValueError(
                    "n_blocks: None with capacity None; allowed: n_blocks (an integer >= 1), or a capacity to size "
                    "the pool for batch_size sequences of that many tokens"
                )
            n_blocks = batch_size * math.ceil(capacity / block_size)
        if not isinstance(cascade, bool):
            raise ValueError(f"cascade: {cascade!r} is not allowed; allowed: True or False")
        refuse_latent(shape, "PagedKVCache")
        self.pool = BlockPool(n_blocks, block_size)
        self.cascade = cascade
        self.codec = kv_codec(codec, shape)
        self._per_sequence_cap = capacity
        self.capacity = n_blocks * block_size if capacity is None else capacity
        slots, dim, dtype, device = n_blocks * block_size, shape.head_dim, shape.torch_dtype, shape.device
        lead = (shape.n_kv_heads,)
        self._keys = [
            make_store(self.codec, lead, slots, dim, dtype, device, True, group_size) for _ in range(shape.n_layers)
        ]
        self._values = [
            make_store(self.codec, lead, slots, dim, dtype, device, False, group_size) for _ in range(shape.n_layers)
        ]
        self._layer_token_bytes = shape.n_kv_heads * (self._keys[0].slot_bytes + self._values[0].slot_bytes)
        self._read_windows: list[int | None] = [None] * shape.n_layers  # as the layers last told them
        self._seq_ids = [self.pool.add_sequence()[0] for _ in range(batch_size)]
        self._pending: list[list[int]] = [[] for _ in range(batch_size)]  # known ids of tokens not yet reserved
        self._start = 0
        self._refresh()

    # -- shape --------------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def length(self) -> int:
        return self.pool.length(self._seq_ids[0])

    def block_tables(self) -> list[list[int]]:
        """One list of block ids per sequence, in batch order."""
        return [self.pool.block_table(s) for s in self._seq_ids]

    # -- the batch ----------------------------------------------------------------------------------------------
    def begin(self, prompts: Sequence[Sequence[int]] | torch.Tensor) -> int:
        """Replace the batch with one sequence per prompt (``[B, T]``, all the same length) and reuse the cache.

        The old sequences are freed; their full blocks stay cached. Returns ``n_cached``: how many leading tokens
        of every prompt already have their K/V in the pool (whole blocks, common to the batch, and fewer than
        ``T`` so that a prefill still yields the last token's logits). The sequences hold those tokens; the
        caller prefills ``prompts[:, n_cached:]``, which gives the same logits as a full prefill would there.
        Prompts in one call do not share with each other; to share a prompt, prefill it once and ``fork``.
        """
        rows = [[int(t) for t in p] for p in prompts]
        if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
            raise ValueError(
                f"prompts: lengths {[len(r) for r in rows]}; allowed: one or more prompts of the same length >= 1"
            )
        for seq_id in self._seq_ids:
            self.pool.free(seq_id)
        hit_blocks = min(len(self.pool.cached_prefix(r)) for r in rows)
        n_cached = min(hit_blocks, (len(rows[0]) - 1) // self.block_size) * self.block_size
        self._seq_ids = [self.pool.add_sequence(r, max_cached_tokens=n_cached)[0] for r in rows]
        self._pending = [r[n_cached:] for r in rows]
        self._refresh()
        return n_cached

    def fork(self, index: int) -> int:
        """Add a copy of sequence ``index`` to the batch, sharing its blocks (copy-on-write); return its index."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.batch_size:
            raise ValueError(f"index: {index!r}; allowed: an integer in [0, {self.batch_size})")
        self._seq_ids.append(self.pool.fork(self._seq_ids[index]))
        self._pending.append(list(self._pending[index]))
        self._refresh()
        return self.batch_size - 1

    def feed_tokens(self, token_ids: Sequence[Sequence[int]] | torch.Tensor) -> None:
        """Declare the ids (``[B, T]``) of the tokens the next steps will store, so their blocks can be cached.

        Steps consume declared ids in order; a step with fewer declared ids than tokens stores them as unknown,
        and a sequence's blocks from there on are never cached.
        """
        rows = [[int(t) for t in r] for r in token_ids]
        if len(rows) != self.batch_size:
            raise ValueError(f"token_ids: {len(rows)} rows; allowed: one row per sequence ({self.batch_size})")
        for pending, row in zip(self._pending, rows, strict=True):
            pending.extend(row)

    def reset(self) -> None:
        """Free every sequence (full blocks stay cached) and start ``batch_size`` empty ones."""
        for seq_id in self._seq_ids:
            self.pool.free(seq_id)
        self._seq_ids = [self.pool.add_sequence()[0] for _ in self._seq_ids]
        self._pending = [[] for _ in self._seq_ids]
        self._refresh()

    # -- a step -------------------------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int:
        require_int("n_new", n_new)
        start = self.length
        if self._per_sequence_cap is not None and start + n_new > self._per_sequence_cap:
            raise CacheCapacityError(
                f"KV cache full: {start} tokens stored, {n_new} more requested, capacity {self.capacity} per "
                "sequence. Create the cache with a larger capacity (or capacity=None with n_blocks)."
            )
        known = all(len(p) >= n_new for p in self._pending)
        grant = self.pool.append(self._seq_ids, n_new, [p[:n_new] for p in self._pending] if known else None)
        for src, dst in grant.copies:  # copy-on-write: the block is about to diverge from its other holders
            src_slots, dst_slots = (slice(b * self.block_size, (b + 1) * self.block_size) for b in (src, dst))
            for store in self._keys + self._values:
                store.move(dst_slots, src_slots)
        self._pending = [p[n_new:] if known else [] for p in self._pending]
        self._start = start
        if grant.copies or math.ceil(self.length / self.block_size) != self._table.shape[1]:
            self._refresh()  # most decode steps write into a block the table already lists
        positions = torch.arange(start, start + n_new, device=self.device)
        blocks = self._table[:, positions // self.block_size].long()  # [B, T]
        self._slots = (slice(None), blocks * self.block_size + positions % self.block_size)  # -> [Hkv, B, T]
        return start

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._keys[layer].write(self._slots, k.permute(2, 0, 1, 3))
        self._values[layer].write(self._slots, v.permute(2, 0, 1, 3))

    def attend(
        self, layer: int, q: torch.Tensor, window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        self._read_windows[layer] = window
        if q.shape[-2] > 1:
            return attend_slab(q, *self._gather(layer, self._table, 0, self.length), self._start, window)
        # Decode: only the blocks holding the window's tokens, [first, length), are gathered.
        first = 0 if window is None else max(0, self.length - window)
        skip_blocks = first // self.block_size
        n_shared = self._cascade_blocks()
        if n_shared > skip_blocks:
            prefix = n_shared * self.block_size
            prefix_k_t, prefix_v = self._gather(layer, self._table[:1, skip_blocks:n_shared], first, prefix)
            suffix = self._gather(layer, self._table[:, n_shared:], prefix, self.length)
            out = cascade_decode_attention(q[..., 0, :], prefix_k_t[0], prefix_v[0], *suffix)
        else:
            out = decode_attention(q[..., 0, :], *self._gather(layer, self._table[:, skip_blocks:], first, self.length))
        return out.unsqueeze(-2)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies, ``[B, Hkv, S, D]`` each: the blocks are not contiguous, so there is no view to return."""
        k_t, v = self._gather(layer, self._table, 0, self.length)
        return k_t.transpose(-1, -2), v

    # -- bytes --------------------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block across all layers: ``2 x layers x Hkv x block_size x slot bytes`` (a slot: one
        token's ``D`` elements of one head, scales included)."""
        return round(self.block_size * self.bytes_per_token)

    def bytes_stored(self) -> int:
        """Blocks the live sequences hold (shared ones once, a partly filled one whole) plus their table entries."""
        tables = self.block_tables()
        n_blocks = len({block for table in tables for block in table})
        return n_blocks * self.block_bytes + TABLE_ENTRY_BYTES * sum(len(t) for t in tables)

    def bytes_allocated(self) -> int:
        """The pool's K/V stores, allocated up front whether blocks are used or not."""
        return sum(s.nbytes for s in self._keys + self._values)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V and block-table bytes a decode step over ``context`` tokens (default ``length``) reads.

        Blocks are read whole (the unused tail of a last block too). A layer that told the cache its sliding window
        reads only the blocks holding the window's tokens. Each layer reads the table entries of the blocks it
        reads. With cascade, the shared blocks and their entries are read once for the batch; without, once per
        sequence. ``context`` other than ``length`` keeps today's shared prefix, capped at ``context``.
        """
        context = self.length if context is None else context
        require_int("context", context, 0)
        per_seq = math.ceil(context / self.block_size)
        shared = min(self._cascade_blocks(), max(context - 1, 0) // self.block_size)
        n_read = 0  # blocks (of one layer) and table entries, summed over layers
        for window in self._read_windows:
            skip = 0 if window is None else max(0, context - window) // self.block_size
            layer_shared = max(0, shared - skip)
            n_read += layer_shared + self.batch_size * (per_seq - skip - layer_shared)
        layer_block_bytes = self.block_size * self._layer_token_bytes
        return round(n_read * layer_block_bytes) + n_read * TABLE_ENTRY_BYTES

    # -- internals ----------------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Rebuild the per-step view of the tables after the batch or its blocks changed."""
        tables = self.block_tables()
        self.batch_size = len(tables)
        self._table = torch.tensor(tables, dtype=torch.int32, device=self.device)  # [B, blocks per sequence]
        # The block holding the newest token is never read as shared: the next write would copy it first.
        self._n_shared = min(shared_prefix_blocks(tables), max(self.length - 1, 0) // self.block_size)

    def _cascade_blocks(self) -> int:
        """Blocks a decode step reads once for the whole batch: 0 unless cascade is on and there is sharing."""
        return self._n_shared if self.cascade and self.batch_size > 1 else 0

    def _gather(self, layer: int, table: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``start .. end-1`` of the blocks ``table`` (``[B, m]``) lists, its first block being the one
        that holds ``start``, as ``k_t``: ``[B, Hkv, D, n]`` and ``v``: ``[B, Hkv, n, D]`` (floats)."""
        lo = start % self.block_size
        hi = lo + end - start
        k = self._keys[layer].take_blocks(table, self.block_size)[:, :, lo:hi]
        v = self._values[layer].take_blocks(table, self.block_size)[:, :, lo:hi]
        return k.transpose(-1, -2), v
