"""Ragged batches in the paged cache (continuous batching): pool sequences picked into a batch at different lengths,
decoded one token each at its own position, each row attending over its own tokens only."""

from __future__ import annotations

import inspect

import pytest
import torch

import kvlab.model.decoder
from kvlab.cache.base import CacheCapacityError, CacheShape
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.model.decoder import Decoder

from .helpers import tiny_config

# The same kernel on the same gathered bytes (a ragged row runs the call a batch of one runs): equal bit for bit.
EXACT = dict(rtol=0, atol=0)
# Two kernels on the same (decoded) K/V: decode_attention over gathered blocks vs the contiguous cache's slab
# (online softmax for int8); outputs (|x| < 4) differ by a few fp32 ulps, a wrong slot or window by 1e-2 or more.
KERNEL_TOL = dict(rtol=1e-5, atol=1e-5)
# Logits of a batch of B rows vs one row: the projections' matmuls may block their sums differently for each M
# (a few fp32 ulps on logits |x| < 1); a wrong position, slot or mask moves them by 1e-3 or more.
LAYOUT_TOL = dict(rtol=1e-5, atol=1e-6)
SHAPE = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)
LENGTHS = (9, 5, 14)  # with blocks of 4: a partial block, a partial one, and a partial one two blocks further
RAGGED_DECODER = "ragged" in inspect.getsource(kvlab.model.decoder.Decoder._run)


def kv(gen: torch.Generator, n: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V for ``n`` tokens: ``[batch, n, Hkv, D]`` each, standard normal."""
    return tuple(torch.randn(batch, n, SHAPE.n_kv_heads, SHAPE.head_dim, generator=gen) for _ in range(2))


def queries(gen: torch.Generator, batch: int) -> torch.Tensor:
    """``[B, Hkv, G=2, 1, D]`` decode queries, scaled as the attention module scales them."""
    return torch.randn(batch, SHAPE.n_kv_heads, 2, 1, SHAPE.head_dim, generator=gen) * SHAPE.head_dim**-0.5


def ragged_pool(codec: str, gen: torch.Generator, cascade: bool = False) -> tuple[PagedKVCache, list, list[int]]:
    """A pool holding sequences of ``LENGTHS`` tokens, each prefilled alone, and per sequence a contiguous cache of
    batch one holding the same K/V. The sequences' blocks interleave: each was stored after the previous one."""
    paged = PagedKVCache(SHAPE, n_blocks=16, block_size=4, codec=codec, cascade=cascade)
    alone = [ContiguousKVCache(SHAPE, capacity=24, codec=codec) for _ in LENGTHS]
    ids = []
    for n, reference in zip(LENGTHS, alone, strict=True):
        seq_id, n_cached = paged.new_sequence()
        assert n_cached == 0
        ids.append(seq_id)
        paged.use([seq_id])
        for cache in (paged, reference):
            cache.reserve(n)
        for layer in range(SHAPE.n_layers):
            k, v = kv(gen, n)
            for cache in (paged, reference):
                cache.append(layer, k, v)
    paged.free(paged.new_sequence()[0])  # a pool sequence never in the batch: freeing it leaves the batch alone
    assert paged.seq_ids == [ids[-1]]
    return paged, alone, ids


# -- attention -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("window", [None, 6, 3])  # 6 reaches back into an earlier block for every row, 3 not
def test_ragged_decode_equals_each_sequence_alone(codec: str, window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    paged, alone, ids = ragged_pool(codec, gen)
    order = [ids[2], ids[0], ids[1]]  # the batch in any order
    paged.use(order)
    assert paged.lengths == [14, 9, 5] and paged.length == 14 and paged.batch_size == 3
    for _ in range(3):  # the second step starts a new block for two of the rows, the third for the last one
        lengths = paged.lengths
        starts = paged.reserve(1)
        assert starts.dtype == torch.long and starts.tolist() == lengths  # each row's new token at its own position
        rows_alone = [alone[ids.index(seq)] for seq in order]
        for cache in rows_alone:
            cache.reserve(1)
        expected = []
        for layer in range(SHAPE.n_layers):
            k, v = kv(gen, 1, batch=3)
            paged.append(layer, k, v)
            for row, cache in enumerate(rows_alone):
                cache.append(layer, k[row : row + 1], v[row : row + 1])
            q = queries(gen, 3)
            out = paged.attend(layer, q, window)
            assert out.shape == q.shape
            expected.append((layer, q, out))
        for layer, q, out in expected:
            for row, cache in enumerate(rows_alone):
                # Against the contiguous cache holding this sequence alone: the right tokens, slots and window.
                want = cache.attend(layer, q[row : row + 1], window)
                torch.testing.assert_close(out[row : row + 1], want, **KERNEL_TOL)
        for layer, q, out in expected:  # the same pool, each sequence as a batch of one
            for row, seq in enumerate(order):
                paged.use([seq])
                torch.testing.assert_close(out[row : row + 1], paged.attend(layer, q[row : row + 1], window), **EXACT)
        paged.use(order)
    assert paged.lengths == [17, 12, 8]


def test_a_ragged_batch_with_shared_blocks_reads_no_cascade_and_counts_each_rows_own_blocks() -> None:
    gen = torch.Generator().manual_seed(1)
    paged = PagedKVCache(SHAPE, n_blocks=16, block_size=4, cascade=True)
    paged.reserve(9)
    for layer in range(SHAPE.n_layers):
        paged.append(layer, *kv(gen, 9))
    parent = paged.seq_ids[0]
    paged.fork(0)
    child = paged.seq_ids[1]
    paged.use([child])  # the fork grows alone by 4: it copies the shared partial block on its first write
    paged.reserve(4)
    for layer in range(SHAPE.n_layers):
        paged.append(layer, *kv(gen, 4))
    paged.use([parent, child])
    assert paged.lengths == [9, 13]
    tables = paged.block_tables()
    assert tables[0][:2] == tables[1][:2] and tables[0][2] != tables[1][2]
    paged.reserve(1)
    for layer in range(SHAPE.n_layers):
        paged.append(layer, *kv(gen, 1, batch=2))
    q = queries(gen, 2)
    out = [paged.attend(layer, q) for layer in range(SHAPE.n_layers)]
    for row, seq in enumerate([parent, child]):
        paged.use([seq])
        for layer in range(SHAPE.n_layers):
            torch.testing.assert_close(out[layer][row : row + 1], paged.attend(layer, q[row : row + 1]), **EXACT)
    paged.use([parent, child])
    # By hand: lengths 10 and 14 in blocks of 4: 3 + 4 blocks, the first 2 shared. One block across layers is
    # 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 tokens x 4 bytes = 2048; one layer's, 1024.
    # Stored: 5 distinct blocks and 3 + 4 int32 table entries.
    assert paged.bytes_stored() == 5 * 2048 + 7 * 4
    # Read: no cascade in a ragged batch, so each row reads its own 3 and 4 blocks, in each of 2 layers, and each
    # block's table entry.
    assert paged.bytes_read_per_step() == 2 * (3 + 4) * (1024 + 4)
    # Windows per row: layer 0 with window 6 starts at 10 - 6 = 4 (block 1) and 14 - 6 = 8 (block 2): 2 + 2 blocks;
    # layer 1 with window 3 starts at 7 (block 1) and 11 (block 2): 2 + 2 blocks.
    paged.attend(0, q, 6)
    paged.attend(1, q, 3)
    assert paged.bytes_read_per_step() == (2 + 2 + 2 + 2) * (1024 + 4)
    # A context given for every row: 10 tokens each, 3 blocks each, windows as above (both rows skip 1 block).
    assert paged.bytes_read_per_step(context=10) == (2 + 2 + 2 + 2) * (1024 + 4)
    assert paged.bytes_written_per_step() == 2 * 2 * 2 * 2 * 16 * 4  # 2 rows x (K, V) x 2 layers x 2 heads x 16 x 4 B


def test_ragged_steps_take_one_token_and_read_refuses() -> None:
    gen = torch.Generator().manual_seed(2)
    paged, _, ids = ragged_pool("fp32", gen)
    paged.use(ids)
    with pytest.raises(ValueError, match=r"n_new: 2 for a batch of sequences at different lengths \(lengths "):
        paged.reserve(2)
    with pytest.raises(ValueError, match=r"read: the batch's sequences are at different lengths \(\[9, 5, 14\]\)"):
        paged.read(0)
    paged.use([ids[0]])
    assert paged.reserve(2) == 9 and isinstance(paged.reserve(1), int)  # one sequence: a plain int, as ever


def test_a_ragged_step_checks_each_sequences_capacity_and_changes_nothing() -> None:
    paged = PagedKVCache(SHAPE, capacity=8, n_blocks=16, block_size=4)
    long_id, short_id = paged.seq_ids[0], paged.new_sequence()[0]
    paged.fast_fill(8)
    paged.use([short_id])
    paged.fast_fill(3)
    paged.use([short_id, long_id])
    before = (paged.lengths, paged.block_tables(), paged.pool.n_free)
    with pytest.raises(CacheCapacityError, match="8 tokens stored, 1 more requested, capacity 8 per sequence"):
        paged.reserve(1)
    assert (paged.lengths, paged.block_tables(), paged.pool.n_free) == before


# -- pool sequences --------------------------------------------------------------------------------------------------
def test_new_sequence_use_and_free_bookkeeping() -> None:
    paged = PagedKVCache(SHAPE, n_blocks=12, block_size=4)
    first_free = paged.pool.n_free
    prompt_a, prompt_b = list(range(1, 11)), list(range(20, 26))  # 10 and 6 tokens
    a, n_a = paged.new_sequence(prompt_a)
    b, n_b = paged.new_sequence(prompt_b)
    assert (n_a, n_b) == (0, 0) and paged.pool.n_free == first_free  # nothing stored yet
    paged.use([b])
    paged.fast_fill(6)  # b's 6 ids were pending: its one full block is registered
    assert paged.pool.n_cached == 1
    paged.use([a])  # a's pending ids survived the steps of b
    paged.fast_fill(6)
    assert paged.pool.n_cached == 1 + 1
    paged.use([b])
    paged.fast_fill(1)  # b has no pending id left: an unknown token, which touches no other sequence's ids
    paged.use([a])
    paged.fast_fill(4)  # the rest of a's prompt, its ids kept across b's step: a's second block is registered
    assert paged.pool.n_cached == 1 + 2
    assert paged.pool.n_free == first_free - 2 - 3
    paged.use([a, b])
    assert paged.seq_ids == [a, b] and paged.lengths == [10, 7] and paged.batch_size == 2

    # A prompt sharing a's 10 tokens plus one: the 2 full blocks (8 tokens) are hits, at most len - 1 = 10 tokens.
    c, n_c = paged.new_sequence(prompt_a + [99])
    assert n_c == 8 and paged.pool.block_table(c) == paged.pool.block_table(a)[:2]
    assert paged.seq_ids == [a, b]  # a new pool sequence is not in the batch
    # Exactly 8 tokens: 7 at most may be cached, so only whole blocks of them: 1.
    assert paged.new_sequence(prompt_a[:8])[1] == 4

    paged.free(a)  # leaves the batch; its blocks stay with c (2) or go back to the pool (1)
    assert paged.seq_ids == [b] and paged.lengths == [7] and paged.batch_size == 1
    assert paged.pool.n_free == first_free - 2 - 3 + 1
    paged.free(b)
    assert paged.seq_ids == [] and paged.batch_size == 0 and paged.length == 0
    assert paged.bytes_read_per_step() == 0 and paged.bytes_stored() == 0
    paged.reset()  # frees the pool sequences outside the batch too; the batch stays empty
    assert paged.pool.sequences() == [] and paged.pool.n_free == first_free
    assert paged.pool.n_cached == 3  # full blocks with known ids stay cached
    assert paged.new_sequence(prompt_a + [99])[1] == 8


def test_bad_sequence_ids_name_themselves() -> None:
    paged = PagedKVCache(SHAPE, n_blocks=8, block_size=4)
    a = paged.seq_ids[0]
    b, _ = paged.new_sequence()
    live = rf"\[{a}, {b}\]"
    for bad in ([99], [a, a], [], [True]):
        with pytest.raises(ValueError, match=rf"seq_ids: .*; allowed: one or more distinct live sequence ids.*{live}"):
            paged.use(bad)
    assert paged.seq_ids == [a]
    paged.free(b)
    with pytest.raises(ValueError, match=rf"seq_id: {b} is not a live sequence.*allowed: one of \[{a}\]"):
        paged.free(b)
    with pytest.raises(ValueError, match=rf"seq_ids: \[{b}\]"):
        paged.use([b])


def test_begin_fork_and_feed_tokens_keep_pool_sequences_outside_the_batch() -> None:
    paged = PagedKVCache(SHAPE, n_blocks=16, block_size=4)
    outside, _ = paged.new_sequence(list(range(1, 6)))
    assert paged.begin([[7, 8, 9], [4, 5, 6]]) == 0
    paged.fork(1)
    paged.feed_tokens([[1], [2], [2]])
    paged.fast_fill(4)  # 3 prompt ids + 1 fed id per row fill each row's first block, with known ids
    assert paged.pool.n_cached == 2  # the fork's block holds its parent's prefix: registered once
    assert outside in paged.pool.sequences()
    paged.use([outside])
    paged.fast_fill(5)  # its pending ids survived begin, fork and the batch's steps
    assert paged.pool.n_cached == 3


# -- the model -------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(
    not RAGGED_DECODER,
    reason="Decoder._run does not yet rope a ragged batch at per-sequence positions (a tensor reserve)",
)
@pytest.mark.parametrize("layer_windows", [None, (5, None)], ids=["global", "local"])
def test_ragged_model_decode_equals_each_sequence_alone(layer_windows: tuple | None) -> None:
    model = Decoder(tiny_config(layer_windows=layer_windows), device="cpu", seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 13, (1, n), generator=gen) for n in (9, 4, 13)]
    follow = torch.randint(0, 13, (3, 4), generator=gen)  # the next 4 tokens of each sequence

    def prefilled() -> tuple[PagedKVCache, list[int]]:
        cache = PagedKVCache.for_model(model, n_blocks=24, block_size=4)
        ids = []
        for prompt in prompts:
            ids.append(cache.new_sequence()[0])
            cache.use([ids[-1]])
            model.prefill(prompt, cache)
        return cache, ids

    ragged, ids = prefilled()
    ragged.use(ids)
    logits = torch.stack([model.decode_step(follow[:, i], ragged) for i in range(4)], dim=1)  # [3, 4, V]
    alone, alone_ids = prefilled()
    for row, seq in enumerate(alone_ids):
        alone.use([seq])
        want = torch.stack([model.decode_step(follow[row : row + 1, i], alone)[0] for i in range(4)])
        torch.testing.assert_close(logits[row], want, **LAYOUT_TOL)
        # And against the model with no cache: SDPA over the whole sequence with its mask.
        whole = torch.cat([prompts[row][0], follow[row]])[None]
        torch.testing.assert_close(logits[row], model.forward(whole)[0, -4:], **KERNEL_TOL)
