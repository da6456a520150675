"""A paged KV cache: K/V live in fixed-size blocks of one pool, reached through per-sequence block tables.

Paging lets a server hold many sequences without reserving ``max_seq_len`` slots for each (lesson 04), lets
sequences and chat turns share the blocks of a common prefix (lesson 05), and lets a step read a prefix the
batch shares once (cascade attention, ``cascade=True``).

Layout: keys ``k[l]``: ``[Hkv, D, n_blocks, block_size]`` and values ``v[l]``: ``[Hkv, n_blocks, block_size, D]``
per layer ``l``; block ``b`` is ``k[l][:, :, b]`` and ``v[l][:, b]``. Inside a block keys are key-major, as in the
contiguous cache, so ``q @ K`` streams runs of tokens. The block index sits inside the head and dim indices (GPU
caches put it outermost) so that gathering a sequence's blocks lands directly in the ``[Hkv, D, S]`` layout
``decode_attention`` takes, in one copy; block-outermost storage needs a second, strided copy to get there.
A block id covers every layer, so one table per sequence serves them all.

Reading: this reference gathers a sequence's blocks into scratch and runs the contiguous cache's kernel on it, so
paged decode equals contiguous decode up to fp32 rounding (the same kernel, over tensors of other sizes and
strides, which a BLAS may block and sum in another order). A fused paged kernel (vLLM's, FlashInfer's) reads the
blocks in place; the gather is an extra copy that the byte counts leave out and CPU timings pay for.

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
from typing import TYPE_CHECKING

import torch

from kvlab.cache.base import KVCache
from kvlab.cache.block_pool import BlockPool
from kvlab.cache.cascade import cascade_decode_attention, shared_prefix_blocks
from kvlab.dtypes import canonical_dtype, torch_dtype
from kvlab.kernels import causal_attention, decode_attention
from kvlab.validation import require_int

if TYPE_CHECKING:
    from kvlab.model import Decoder

TABLE_ENTRY_BYTES = 4  # block tables are int32, as in vLLM and FlashInfer


class PagedKVCache(KVCache):
    """``n_blocks`` blocks of ``block_size`` tokens, shared by a batch of sequences that advance together.

    The batch starts as ``batch_size`` empty sequences; ``begin`` replaces it (with prefix hits), ``fork``
    grows it. ``reserve`` raises ``PoolExhaustedError`` (a ``CacheCapacityError``) before changing anything
    when the pool is short. With ``cascade=True``, a decode step reads the blocks every sequence shares once.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_blocks: int,
        block_size: int = 16,
        batch_size: int = 1,
        dtype: str | torch.dtype = "fp32",
        device: str | torch.device = "cpu",
        cascade: bool = False,
    ) -> None:
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            require_int(name, value)
        require_int("batch_size", batch_size)
        if not isinstance(cascade, bool):
            raise ValueError(f"cascade: {cascade!r} is not allowed; allowed: True or False")
        self.pool = BlockPool(n_blocks, block_size)
        self.n_layers, self.n_kv_heads, self.head_dim, self.cascade = n_layers, n_kv_heads, head_dim, cascade
        self.dtype_name = canonical_dtype(dtype, "kv dtype", allowed=("fp32", "fp16", "bf16"))
        tdtype = torch_dtype(self.dtype_name)
        self._k = torch.zeros(n_layers, n_kv_heads, head_dim, n_blocks, block_size, dtype=tdtype, device=device)
        self._v = torch.zeros(n_layers, n_kv_heads, n_blocks, block_size, head_dim, dtype=tdtype, device=device)
        self._k_layers = list(self._k.unbind(0))
        self._v_layers = list(self._v.unbind(0))
        # Gathers index dim 1 of these 3-d views: on CPU, index_select on dim 2 of the 4-d K ran several times slower.
        self._k_rows = [k.view(n_kv_heads * head_dim, n_blocks, block_size) for k in self._k_layers]
        self._v_rows = [v.view(n_kv_heads, n_blocks, block_size * head_dim) for v in self._v_layers]
        self._scale = 1.0 / math.sqrt(head_dim)
        self._seq_ids = [self.pool.add_sequence()[0] for _ in range(batch_size)]
        self._pending: list[list[int]] = [[] for _ in range(batch_size)]  # known ids of tokens not yet reserved
        self._start = 0
        self._refresh()

    @classmethod
    def for_model(
        cls, model: Decoder, n_blocks: int, block_size: int = 16, batch_size: int = 1, cascade: bool = False
    ) -> PagedKVCache:
        """A paged cache with ``model``'s layer count, KV heads, head dim, dtype and device."""
        cfg = model.cfg
        return cls(
            cfg.n_layers,
            cfg.n_kv_heads,
            cfg.head_dim,
            n_blocks,
            block_size,
            batch_size,
            dtype=model.dtype,
            device=model.device,
            cascade=cascade,
        )

    # -- shape --------------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def batch_size(self) -> int:
        return len(self._seq_ids)

    @property
    def capacity(self) -> int:
        """The most tokens one sequence could hold: the whole pool."""
        return self.pool.n_blocks * self.block_size

    @property
    def length(self) -> int:
        return self.pool.length(self._seq_ids[0])

    @property
    def element_bytes(self) -> float:
        return self._k.element_size()

    @property
    def device(self) -> torch.device:
        return self._k.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return self._k.dtype

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
        if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new <= 0:
            raise ValueError(f"n_new: {n_new!r} is not allowed; allowed: a positive integer")
        start = self.length
        known = all(len(p) >= n_new for p in self._pending)
        grant = self.pool.append(self._seq_ids, n_new, [p[:n_new] for p in self._pending] if known else None)
        for src, dst in grant.copies:  # copy-on-write: the block is about to diverge from its other holders
            self._k[:, :, :, dst] = self._k[:, :, :, src]
            self._v[:, :, dst] = self._v[:, :, src]
        self._pending = [p[n_new:] if known else [] for p in self._pending]
        self._start = start
        if grant.copies or math.ceil(self.length / self.block_size) != self._table.shape[1]:
            self._refresh()  # most decode steps write into a block the table already lists
        positions = torch.arange(start, start + n_new, device=self.device)
        self._slot_blocks = self._table[:, positions // self.block_size].long()  # [B, T]
        self._slot_offsets = positions % self.block_size  # [T]
        return start

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # (block, offset) index pairs of shape [B, T] select [Hkv, D, B, T] of K and [Hkv, B, T, D] of V.
        self._k_layers[layer][:, :, self._slot_blocks, self._slot_offsets] = k.permute(2, 3, 0, 1)
        self._v_layers[layer][:, self._slot_blocks, self._slot_offsets] = v.permute(2, 0, 1, 3)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, t, h, d = q.shape
        if t > 1:
            k_t, v = self._gather(layer, self._table, self.length)
            return causal_attention(q.transpose(1, 2), k_t.transpose(-1, -2), v, q_start=self._start).transpose(1, 2)
        q = (q * self._scale).view(b, self.n_kv_heads, h // self.n_kv_heads, d)
        n_shared = self._cascade_blocks()
        if n_shared:
            prefix = n_shared * self.block_size
            prefix_k_t, prefix_v = self._gather(layer, self._table[:1, :n_shared], prefix)
            suffix_k_t, suffix_v = self._gather(layer, self._table[:, n_shared:], self.length - prefix)
            out = cascade_decode_attention(q, prefix_k_t[0], prefix_v[0], suffix_k_t, suffix_v)
        else:
            out = decode_attention(q, *self._gather(layer, self._table, self.length))
        return out.reshape(b, 1, h, d)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies, ``[B, Hkv, S, D]`` each: the blocks are not contiguous, so there is no view to return."""
        k_t, v = self._gather(layer, self._table, self.length)
        return k_t.transpose(-1, -2), v

    # -- bytes --------------------------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block across all layers: ``2 x layers x Hkv x D x block_size x element bytes``."""
        return round(2 * self.n_layers * self.n_kv_heads * self.head_dim * self.block_size * self.element_bytes)

    def bytes_stored(self) -> int:
        """Blocks the live sequences hold (shared ones once, a partly filled one whole) plus their table entries."""
        tables = self.block_tables()
        n_blocks = len({block for table in tables for block in table})
        return n_blocks * self.block_bytes + TABLE_ENTRY_BYTES * sum(len(t) for t in tables)

    def bytes_allocated(self) -> int:
        """The pool's K/V slab, allocated up front whether blocks are used or not."""
        return self.pool.n_blocks * self.block_bytes

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V and block-table bytes a decode step over ``context`` tokens (default ``length``) reads.

        Blocks are read whole (the unused tail of a last block too). Each layer reads the table entries of the
        blocks it reads. With cascade, the shared blocks and their entries are read once for the batch; without,
        once per sequence. ``context`` other than ``length`` keeps today's shared prefix, capped at ``context``.
        """
        context = self.length if context is None else context
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise ValueError(f"context: {context!r}; allowed: an integer >= 0")
        per_seq = math.ceil(context / self.block_size)
        shared = min(self._cascade_blocks(), max(context - 1, 0) // self.block_size)
        n_read = shared + self.batch_size * (per_seq - shared)
        return n_read * self.block_bytes + self.n_layers * n_read * TABLE_ENTRY_BYTES

    # -- internals ----------------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Rebuild the per-step view of the tables after the batch or its blocks changed."""
        tables = self.block_tables()
        self._table = torch.tensor(tables, dtype=torch.int32, device=self.device)  # [B, blocks per sequence]
        # The block holding the newest token is never read as shared: the next write would copy it first.
        self._n_shared = min(shared_prefix_blocks(tables), max(self.length - 1, 0) // self.block_size)

    def _cascade_blocks(self) -> int:
        """Blocks a decode step reads once for the whole batch: 0 unless cascade is on and there is sharing."""
        return self._n_shared if self.cascade and self.batch_size > 1 else 0

    def _gather(self, layer: int, table: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n_tokens`` of the blocks ``table`` (``[B, n]``) lists, as ``k_t``: ``[B, Hkv, D, n_tokens]``
        and ``v``: ``[B, Hkv, n_tokens, D]``, the layout ``decode_attention`` takes."""
        b, n = table.shape
        hkv, d, span = self.n_kv_heads, self.head_dim, table.shape[1] * self.block_size
        flat = table.reshape(-1)
        k_t = self._k_rows[layer].index_select(1, flat).view(hkv, d, b, span).permute(2, 0, 1, 3)
        v = self._v_rows[layer].index_select(1, flat).view(hkv, b, span, d).transpose(0, 1)
        return k_t[..., :n_tokens], v[:, :, :n_tokens]
