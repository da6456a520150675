"""A paged KV cache: K/V live in fixed-size blocks of one pool, reached through per-sequence block tables.

Paging lets a server hold many sequences without reserving ``max_seq_len`` slots for each (lesson 04), lets
sequences and chat turns share the blocks of a common prefix (lesson 05), and lets a step read a prefix the
batch shares once (cascade attention, ``cascade=True``).

Layout: per layer, one key store and one value store (``kvlab.cache.codec.stores``) with lead ``(Hkv,)`` and
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
CPU timings pay for. A layer with a sliding window gathers only the blocks its window reaches. On CUDA with
``kvlab[gpu]`` installed, a decode step that does not cascade runs ``kvlab.kernels.triton`` instead, which reads
the blocks in place, in one launch for a ragged batch too.

Prefix hits: the cache can only hash blocks whose token ids it knows, and ``Decoder`` hands a cache no token ids.
``begin(prompts)`` tells it the prompts; ``feed_tokens`` tells it the tokens of the next steps (the sampled ones)::

    cache = PagedKVCache.for_model(model, n_blocks=256, block_size=16)
    n_cached = cache.begin([prompt])          # leading tokens whose K/V are already in the pool
    logits = model.prefill(torch.tensor([prompt[n_cached:]]), cache)[:, -1]
    token = logits.argmax(-1)
    cache.feed_tokens(token[:, None])         # optional: lets the response's blocks be cached for the next turn
    logits = model.decode_step(token, cache)

Continuous batching: the pool holds sequences, the batch is the ones a model call runs on. ``new_sequence`` adds
one to the pool (with its prefix hits), ``use`` picks the batch (in any order, at any lengths), ``free`` drops
one. A batch whose sequences sit at different lengths (ragged) steps one token per sequence, each at its own
position: ``reserve`` then returns a tensor of positions, and the model ropes each row at its own::

    a, n_a = cache.new_sequence(prompt_a)     # per request: prefill it alone
    cache.use([a])
    model.prefill(torch.tensor([prompt_a[n_a:]]), cache)
    cache.use([a, b])                         # then decode the running requests together
    logits = model.decode_step(next_tokens, cache)

A ragged decode step attends each row over its own blocks alone, one kernel call per row: a row never reads
another's padding, a window starts at the row's own position, and ``bytes_read_per_step`` counts what is read.
A fused paged kernel takes per-row lengths and does the same in one launch; here the loop costs B small calls per
layer, which only ragged steps pay.

Window + sinks (StreamingLLM, in blocks, as vLLM's sliding window): ``window=W, sinks=S`` keeps a sequence's first S
tokens and its W most recent, in every layer; the policy (``kvlab.cache.policy.keep``) says which positions a step
reads and which blocks can go, the pool says where they are. Keys stay roped at their original positions, so the
logits match ``WindowKVCache(positions="original")``. Before a step, the blocks no query can see any more go back
to the pool and become holes in the table, so a sequence holds at most ``ceil(S/B) + ceil(W/B) + 1`` blocks. A
decode step attends to exactly the kept positions; a multi-token step gathers those any of its queries sees and
masks each query to its own keep-set, so a chunk equals its tokens one at a time. A window evicts, so it cannot
roll back (speculative decoding refuses it), and it has no cascade. Its blocks' prefix hashes stay valid: a block's
K/V depend on the prefix and the policy, and every sequence of a cache runs the same policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvlab.cache.base import CacheCapacityError, CacheShape, KVCache, Rotate, kv_codec, refuse_latent
from kvlab.cache.codec.stores import make_store
from kvlab.cache.policy.keep import KeepPolicy, positions_of
from kvlab.cache.storage.block_pool import HOLE, BlockPool, int_tuple, shared_prefix_blocks
from kvlab.kernels.fused import fused_kernels
from kvlab.kernels.reference import (
    MAX_SCORES,
    attend_slab,
    attention_with_probs,
    cascade_decode_attention,
    decode_attention,
    online_softmax_attention,
)
from kvlab.spec.keep import SinksAndWindow, Span, count_blocks
from kvlab.spec.validation import require_bool, require_int

TABLE_ENTRY_BYTES = 4  # block tables are int32, as in vLLM and FlashInfer


class PagedKVCache(KVCache):
    """``n_blocks`` blocks of ``block_size`` tokens, shared by the sequences of a pool, a batch of which steps.

    ``n_blocks`` defaults to enough blocks for ``batch_size`` sequences of ``capacity`` tokens each. With
    ``n_blocks`` given, ``capacity`` may be ``None``: a sequence may then grow until the pool runs out (``capacity``
    reads as the whole pool, ``n_blocks x block_size``); with both given, ``capacity`` caps each sequence.
    ``codec`` (default: the dtype K/V arrive in) is any of ``kvlab.spec.dtypes.KV_DTYPES``, ``group_size`` channels per
    scale for fp8/int8/int4.

    The batch starts as ``batch_size`` empty sequences (``batch_size=0``: a pool with none yet, as a server starts,
    which ``n_blocks`` sizes); ``begin`` replaces it (with prefix hits), ``fork`` grows
    it, ``use`` makes it any of the pool's sequences (``new_sequence`` adds them), so ``batch_size`` follows the
    batch. Its sequences may sit at different lengths; such a batch steps one token per sequence (module
    docstring). ``reserve`` raises ``PoolExhaustedError`` (a ``CacheCapacityError``) before changing anything when
    the pool is short. With ``cascade=True``, a decode step of a batch at one length reads the blocks every
    sequence shares once. ``window`` (tokens, >= 1) and ``sinks`` (tokens, >= 0, only with a window) keep each
    sequence's first ``sinks`` and its ``window`` most recent tokens, in every layer, and give the other blocks
    back to the pool (module docstring); such a cache cannot roll back, nor cascade.
    """

    _rolls_back = True
    _min_batch_size = 0
    prefill_is_stepwise = True  # module docstring: a chunk equals its tokens one at a time, window or not

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
        window: int | None = None,
        sinks: int = 0,
    ) -> None:
        super().__init__(shape, batch_size, capacity)
        require_int("block_size", block_size)
        SinksAndWindow(window, sinks)  # validates both; KeepPolicy would silently drop sinks given no window
        if window is not None and cascade:
            raise ValueError("cascade: True with a window is not supported; allowed: cascade=False with a window")
        if n_blocks is None:
            if batch_size == 0:
                raise ValueError("n_blocks: None with batch_size 0; allowed: n_blocks (an integer >= 1) for the pool")
            if capacity is None:
                raise ValueError(
                    "n_blocks: None with capacity None; allowed: n_blocks (an integer >= 1), or a capacity to size "
                    "the pool for batch_size sequences of that many tokens"
                )
            n_blocks = batch_size * math.ceil(capacity / block_size)
        require_bool("cascade", cascade)
        refuse_latent(shape, "PagedKVCache")
        self.pool = BlockPool(n_blocks, block_size)
        self.cascade = cascade
        self.window, self.sinks = window, sinks
        # A block holds every layer's K/V, so the window is one for all layers.
        self.keep = KeepPolicy([window] * shape.n_layers, sinks, shape.n_layers)
        if window is not None:  # the tokens a rollback would bring back may already be gone
            self._rolls_back = False
            self._no_rollback = (
                "its window gave evicted tokens' blocks back to the pool (PagedKVCache without a window can)"
            )
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
        self._pending: dict[int, list[int]] = {}  # per pool sequence: known ids of tokens not yet reserved
        self._seq_ids = [self._add([], 0)[0] for _ in range(batch_size)]
        self._start: int | torch.Tensor = 0
        self._refresh()

    # -- shape --------------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def length(self) -> int:
        """Tokens stored in the longest sequence of the batch (each row's own: ``lengths``)."""
        return self._length

    @property
    def lengths(self) -> list[int]:
        """Tokens stored per sequence, in batch order."""
        return list(self._lengths)

    @property
    def seq_ids(self) -> list[int]:
        """The pool sequences the batch runs on, in batch order (a copy: change the batch with ``use``)."""
        return list(self._seq_ids)

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
            self._drop(seq_id)
        hit_blocks = min(len(self.pool.cached_prefix(r)) for r in rows)
        n_cached = min(hit_blocks, (len(rows[0]) - 1) // self.block_size) * self.block_size
        self._seq_ids = [self._add(r, n_cached)[0] for r in rows]
        self._refresh()
        return n_cached

    def new_sequence(self, token_ids: Sequence[int] | torch.Tensor = ()) -> tuple[int, int]:
        """Add a sequence to the pool (not the batch) that starts with ``token_ids``; return ``(seq_id, n_cached)``.

        As ``begin`` for one prompt: the sequence holds the prompt's leading tokens whose K/V are already in the
        pool (whole blocks, fewer than ``len(token_ids)`` so that a prefill still yields the last token's logits);
        the caller ``use``s it and prefills ``token_ids[n_cached:]``, whose ids the cache keeps until they are
        stored, so their blocks can be cached.
        """
        ids = int_tuple(token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)
        return self._add(ids, max(len(ids) - 1, 0) // self.block_size * self.block_size)

    def use(self, seq_ids: Sequence[int]) -> None:
        """Make the batch these pool sequences, in this order, at whatever lengths they are."""
        ids, live = list(seq_ids), self.pool.sequences()
        if not ids or len(set(ids)) != len(ids) or any(isinstance(s, bool) or s not in live for s in ids):
            raise ValueError(f"seq_ids: {ids}; allowed: one or more distinct live sequence ids, from {live}")
        self._seq_ids = ids
        self._refresh()

    def free(self, seq_id: int) -> None:
        """Drop a pool sequence (its full blocks stay cached); if it is in the batch, it leaves the batch."""
        self._drop(seq_id)
        if seq_id in self._seq_ids:
            self._seq_ids.remove(seq_id)
            self._refresh()

    def fork(self, index: int) -> int:
        """Add a copy of sequence ``index`` to the batch, sharing its blocks (copy-on-write); return its index."""
        require_int("index", index, 0, self.batch_size - 1)
        parent = self._seq_ids[index]
        self._seq_ids.append(self.pool.fork(parent))
        self._pending[self._seq_ids[-1]] = list(self._pending[parent])
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
        for seq_id, row in zip(self._seq_ids, rows, strict=True):
            self._pending[seq_id].extend(row)

    def reset(self) -> None:
        """Free every pool sequence, in the batch or not (full blocks stay cached); the batch becomes
        ``batch_size`` empty ones."""
        for seq_id in list(self._pending):
            self._drop(seq_id)
        self._seq_ids = [self._add([], 0)[0] for _ in self._seq_ids]
        self._refresh()

    def _forget(self, length: int) -> None:
        """Shorten every sequence of the batch longer than ``length``; their blocks past it go back to the pool."""
        for seq_id in self._seq_ids:
            if self.pool.length(seq_id) > length:
                self.pool.truncate(seq_id, length)
                self._pending[seq_id] = []  # ids declared for positions that now hold other tokens
        self._refresh()

    # -- a step -------------------------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int | torch.Tensor:
        """Claim ``n_new`` slots per sequence; return the first one's position: an int for a batch at one length,
        a LongTensor ``[B]`` (each row's own) for a ragged batch, which takes ``n_new=1`` only."""
        require_int("n_new", n_new)
        if not self._seq_ids:
            raise ValueError(
                "reserve: the batch has no sequence; allowed: a batch of one or more (new_sequence, then use)"
            )
        if self._ragged and n_new != 1:
            raise ValueError(
                f"n_new: {n_new} for a batch of sequences at different lengths (lengths {self._lengths}), which "
                "takes one token per sequence; allowed: 1, or use([seq_id]) to prefill one sequence"
            )
        start = self._length
        if self._per_sequence_cap is not None and start + n_new > self._per_sequence_cap:
            raise CacheCapacityError(
                f"KV cache full: {start} tokens stored, {n_new} more requested, capacity {self.capacity} per "
                "sequence. Create the cache with a larger capacity (or capacity=None with n_blocks)."
            )
        released = self._release_evicted()  # first, so the step can reuse them (a failed step leaves them free)
        pending = [self._pending[s] for s in self._seq_ids]
        known = all(len(p) >= n_new for p in pending)
        grant = self.pool.append(self._seq_ids, n_new, [p[:n_new] for p in pending] if known else None)
        for src, dst in grant.copies:  # copy-on-write: the block is about to diverge from its other holders
            src_slots, dst_slots = (slice(b * self.block_size, (b + 1) * self.block_size) for b in (src, dst))
            for store in self._keys + self._values:
                store.move(dst_slots, src_slots)
        for seq_id, p in zip(self._seq_ids, pending, strict=True):
            self._pending[seq_id] = p[n_new:] if known else []
        before, self._length = self._lengths, start + n_new
        self._lengths = [n + n_new for n in before]
        if self._ragged:  # a row gains a block when its new token starts one
            grew = any(n % self.block_size == 0 for n in before)
            positions = torch.tensor(before, device=self.device)[:, None]  # [B, 1]
        else:
            grew = math.ceil(self._length / self.block_size) != self._width
            positions = torch.arange(start, start + n_new, device=self.device)  # [T], the same for every row
        if grant.copies or grew or released:
            self._refresh()  # most decode steps write into a block the table already lists
        self._positions, self._slots_cache = positions, None  # [B, 1] ragged, [T] otherwise: ``_slots`` maps them
        self._start = positions[:, 0] if self._ragged else start
        return self._start

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._keys[layer].write(self._slots, k.permute(2, 0, 1, 3))
        self._values[layer].write(self._slots, v.permute(2, 0, 1, 3))

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        self._read_windows[layer] = layer_window
        if q.shape[-2] > 1:  # a batch at one length: a ragged one steps a token per row
            if self.window is not None:
                return self._attend_kept(layer, q, self._table, self._start, self.length, layer_window)
            return attend_slab(q, *self._gather(layer, self._table, 0, self.length), self._start, layer_window)
        fused = fused_kernels(q.device)
        if fused is not None and not self._cascade_blocks() and self.window is None:
            # One launch for the batch, ragged or not, reading each row's blocks in place through its table.
            lengths = torch.tensor(self._lengths, dtype=torch.int32, device=self.device)
            keys, values, size = self._keys[layer], self._values[layer], self.block_size
            table = self._table
            out = fused.decode(q[..., 0, :], keys, values, lengths, table=table, block_size=size, window=layer_window)
            return out.unsqueeze(-2)
        if not self._ragged:
            return self._decode(layer, q[..., 0, :], self._table, self.length, layer_window).unsqueeze(-2)
        # Each row over its own blocks, so no row reads another's padding or a token past its own position.
        rows = [
            self._decode(layer, q[i : i + 1, ..., 0, :], self._table[i : i + 1], n, layer_window)
            for i, n in enumerate(self._lengths)
        ]
        return torch.cat(rows).unsqueeze(-2)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies, ``[B, Hkv, S, D]`` each: the blocks are not contiguous, so there is no view to return.

        A ragged batch has no such rectangle (``ValueError``); ``use([seq_id])`` reads one sequence. With a window,
        the kept tokens (the sinks, then the window), in position order.
        """
        if self._ragged:
            raise ValueError(
                f"read: the batch's sequences are at different lengths ({self._lengths}), which no [B, Hkv, S, D] "
                "holds; allowed: a batch at one length; use([seq_id]) to read one sequence"
            )
        n = self.length
        k_t, v = self._gather_spans(layer, self._table, self.keep.spans(layer, n - 1, n) or [(0, 0)])
        return k_t.transpose(-1, -2), v

    # -- bytes --------------------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block across all layers: ``2 x layers x Hkv x block_size x slot bytes`` (a slot: one
        token's ``D`` elements of one head, scales included)."""
        return round(self.block_size * self.bytes_per_token)

    def bytes_stored(self) -> int:
        """Blocks the live sequences hold (shared ones once, a partly filled one whole) plus their table entries
        (a window's holes are neither)."""
        tables = [[b for b in t if b != HOLE] for t in self.block_tables()]
        n_blocks = len({block for table in tables for block in table})
        return n_blocks * self.block_bytes + TABLE_ENTRY_BYTES * sum(len(t) for t in tables)

    def bytes_allocated(self) -> int:
        """The pool's K/V stores, allocated up front whether blocks are used or not."""
        return sum(s.nbytes for s in self._keys + self._values)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V and block-table bytes a decode step over ``context`` tokens per sequence (default: each sequence's
        own length) reads.

        Blocks are read whole (the unused tail of a last block too). A layer that told the cache its sliding window
        reads only the blocks holding the window's tokens (per sequence, from its own position). Each layer reads
        the table entries of the blocks it reads. With cascade, the shared blocks and their entries are read once
        for the batch; without (or for a ragged batch), once per sequence. ``context`` other than ``length`` keeps
        today's shared prefix, capped at ``context``. With the cache's window, the blocks holding the sinks and the
        window (within the layer's window too), per sequence.
        """
        longest = self.length if context is None else context
        require_int("context", longest, 0)
        contexts = self._lengths if context is None else [context] * self.batch_size
        size = self.block_size
        shared = min(self._cascade_blocks(), max(longest - 1, 0) // size)
        n_read = 0  # blocks (of one layer) and table entries, summed over layers
        for layer, window in enumerate(self._read_windows):
            spans = [self.keep.spans(layer, n - 1, n, window) for n in contexts if n]
            # Blocks are shared only in a batch at one length (cascade, no cache window), where every row skips
            # the same blocks.
            layer_shared = max(0, shared - min((s[0][0] // size for s in spans), default=0))
            n_read += layer_shared + sum(count_blocks(s, size) - layer_shared for s in spans)
        layer_block_bytes = self.block_size * self._layer_token_bytes
        return round(n_read * layer_block_bytes) + n_read * TABLE_ENTRY_BYTES

    # -- internals ----------------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Rebuild the per-step view of the batch (lengths, tables) after the batch or its blocks changed."""
        tables = self.block_tables()
        self.batch_size = len(tables)
        self._lengths = [self.pool.length(s) for s in self._seq_ids]
        self._length = max(self._lengths, default=0)
        self._ragged = len(set(self._lengths)) > 1
        self._width = max((len(t) for t in tables), default=0)
        self._tables, self._table_tensor = tables, None  # the tensor is built when a read or write needs it
        # The block holding the newest token is never read as shared: the next write would copy it first. A
        # ragged batch shares nothing: cascade needs every row to read the same prefix at the same length. Only a
        # cascading cache looks: the scan costs as much as the rest of a step for a large batch of long tables.
        shared = shared_prefix_blocks(tables) if self.cascade and not self._ragged else 0
        self._n_shared = min(shared, max(self.length - 1, 0) // self.block_size)

    @property
    def _table(self) -> torch.Tensor:
        """The batch's block tables, padded to the longest: ``[B, m]`` int32. Built on first use after a change: a
        caller that only keeps the books (an engine's stand-in model) never reads it, and building it costs as much
        as the rest of such a step."""
        if self._table_tensor is None:
            padded = [t + [HOLE] * (self._width - len(t)) for t in self._tables]
            table = torch.tensor(padded, dtype=torch.int32, device=self.device)
            self._table_tensor = table.view(len(padded), self._width)
        return self._table_tensor

    @property
    def _slots(self) -> tuple[slice, torch.Tensor]:
        """Where the reserved tokens go in each layer's store (-> ``[Hkv, B, T]``), from the step's positions, once
        per step (every layer writes the same slots)."""
        if self._slots_cache is None:
            positions = self._positions
            if self._ragged:
                blocks = self._table.gather(1, positions // self.block_size).long()  # [B, 1]
            else:
                blocks = self._table[:, positions // self.block_size].long()  # [B, T]
            self._slots_cache = (slice(None), blocks * self.block_size + positions % self.block_size)
        return self._slots_cache

    def _cascade_blocks(self) -> int:
        """Blocks a decode step reads once for the whole batch: 0 unless cascade is on and there is sharing."""
        return self._n_shared if self.cascade and self.batch_size > 1 else 0

    def _add(self, token_ids: Sequence[int], max_cached_tokens: int) -> tuple[int, int]:
        """A new pool sequence with ``token_ids``' prefix hits (at most ``max_cached_tokens``); the rest pending."""
        seq_id, n_cached = self.pool.add_sequence(token_ids, max_cached_tokens)
        self._pending[seq_id] = list(token_ids[n_cached:])
        return seq_id, n_cached

    def _drop(self, seq_id: int) -> None:
        self.pool.free(seq_id)
        del self._pending[seq_id]

    def _release_evicted(self) -> bool:
        """Give back the blocks no query of the coming step can see (between the sinks' blocks and the block
        holding the oldest token the first new query's window reaches), per sequence of the batch; whether any
        went back. Each sequence's first new token sits at its current length."""
        if self.window is None:
            return False
        released = False
        for seq_id in self._seq_ids:
            gone = self.keep.blocks_gone(self.pool.length(seq_id), self.block_size)
            released |= self.pool.release_gone(seq_id, gone)
        return released

    def _attend_kept(
        self, layer: int, q: torch.Tensor, table: torch.Tensor, first: int, end: int, layer_window: int | None
    ) -> torch.Tensor:
        """The cache window's multi-token step: queries ``q`` (``[B, Hkv, G, T, D]``) at positions ``first ..
        end-1`` over the positions any of them sees, gathered from ``table`` (``[B, m]``, rows at one length), each
        query masked to its own keep-set (the tokens its later neighbours still see, it may not) -> ``[B, Hkv, G,
        T, D]``."""
        b, hkv, g, n_q, _ = q.shape
        n_slots = n_q + self.sinks + self.window  # at least the positions the step gathers
        block = max(1, MAX_SCORES // (b * hkv * g * n_slots))
        if block < n_q:  # a long prefill chunk: a block of queries at a time, each over what its queries keep
            parts = [
                self._attend_kept(
                    layer, q[..., i : i + block, :], table, first + i, min(end, first + i + block), layer_window
                )
                for i in range(0, n_q, block)
            ]
            return torch.cat(parts, dim=-2)
        spans = self.keep.spans(layer, first, end, layer_window)
        k_t, v = self._gather_spans(layer, table, spans)
        q_positions = torch.arange(first, end, device=self.device)
        mask = self.keep.mask(layer, q_positions, positions_of(spans, self.device), layer_window)
        return attention_with_probs(q, k_t, v, mask)[0]

    def _decode(
        self, layer: int, q: torch.Tensor, table: torch.Tensor, length: int, window: int | None
    ) -> torch.Tensor:
        """One query per row (``q``: ``[B, Hkv, G, D]``) over the ``length`` tokens of ``table``'s rows (``[B, m]``,
        at one length). Only the positions the query sees (``self.keep``: the layer's window, the cache's sinks
        and window) are gathered."""
        spans = self.keep.spans(layer, length - 1, length, window)
        first = spans[0][0]
        n_shared = self._cascade_blocks()  # no cascade with a cache window: then one span, ending at ``length``
        if n_shared > first // self.block_size:
            skip_blocks = first // self.block_size
            prefix = n_shared * self.block_size
            prefix_k_t, prefix_v = self._gather(layer, table[:1, skip_blocks:n_shared], first, prefix)
            suffix = self._gather(layer, table[:, n_shared:], prefix, length)
            return cascade_decode_attention(q, prefix_k_t[0], prefix_v[0], *suffix)
        parts = self._gather_parts(layer, table, spans)
        if len(parts) == 1:
            return decode_attention(q, *parts[0])
        # The sinks and the window: attention over each, merged by their lse, so the two are never copied into one.
        return online_softmax_attention(q, ((k_t.transpose(-1, -2), v, 0) for k_t, v in parts))

    def _gather_parts(
        self, layer: int, table: torch.Tensor, spans: list[Span]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The positions of each of ``spans`` in the blocks of ``table`` (``[B, m]``), as ``k_t``: ``[B, Hkv, D,
        n]`` and ``v``: ``[B, Hkv, n, D]`` (floats), one pair per span."""
        size = self.block_size
        return [self._gather(layer, table[:, lo // size : math.ceil(hi / size)], lo, hi) for lo, hi in spans]

    def _gather_spans(self, layer: int, table: torch.Tensor, spans: list[Span]) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of ``spans`` (sorted, disjoint) in the blocks of ``table``, in order, as one ``k_t``, ``v``
        pair (shapes as ``_gather_parts``)."""
        parts = self._gather_parts(layer, table, spans)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts], dim=-1), torch.cat([v for _, v in parts], dim=-2)

    def _gather(self, layer: int, table: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``start .. end-1`` of the blocks ``table`` (``[B, m]``) lists, its first block being the one
        that holds ``start``, as ``k_t``: ``[B, Hkv, D, n]`` and ``v``: ``[B, Hkv, n, D]`` (floats)."""
        lo = start % self.block_size
        hi = lo + end - start
        first = self._run_start(table)
        if first is not None:  # one span of the pool's slots: read it in place, as a contiguous cache would
            base = first * self.block_size
            k = self._keys[layer].read(base + hi, base + lo)[None]
            v = self._values[layer].read(base + hi, base + lo)[None]
            return k.transpose(-1, -2), v
        k = self._keys[layer].take_blocks(table, self.block_size)[:, :, lo:hi]
        v = self._values[layer].take_blocks(table, self.block_size)[:, :, lo:hi]
        return k.transpose(-1, -2), v

    def _run_start(self, table: torch.Tensor) -> int | None:
        """The first block id when ``table`` is one row of consecutive float blocks on the CPU, else None.

        Such a row is one span of slots, and a view of it is what the gather would copy. A sequence alone in a
        pool gets its blocks in order, so a single request (``kvlab serve --max-batch 1``) decodes without the
        gather's read-write-read (docs/measurements.md: paged rows). On CUDA the fused kernel reads any table in
        place; an encoded block is decoded to floats either way.
        """
        if table.shape[0] != 1 or self.device.type != "cpu" or self._keys[0].encoded:
            return None
        row = table[0]
        first, n = int(row[0]), row.numel()
        if first < 0 or int(row[-1]) - first != n - 1 or (n > 2 and not bool((row.diff() == 1).all())):
            return None
        return first
