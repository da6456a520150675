"""Paged KV storage: equality with the contiguous cache (for every codec), copy-on-write, prefix caching, LRU reuse,
exhaustion, preemption, cascade attention, sliding windows and byte accounting."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.base import CacheCapacityError, CacheShape
from kvlab.cache.codec.codecs import get_codec
from kvlab.cache.storage.block_pool import BlockPool, PoolExhaustedError, shared_prefix_blocks
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.kernels.reference import cascade_decode_attention, decode_attention
from kvlab.model.decoder import Decoder

from .helpers import tiny_config

# For results of one function on the same data in the same layout, and for copies of bytes: equal bit for bit.
EXACT = dict(rtol=0, atol=0)
# Paged and contiguous K/V reach the same kernels through different strides (a gathered scratch copy of
# block_size-token runs vs. a capacity-wide slab), and cascade merges two partial softmaxes by log-sum-exp; a BLAS or
# SDPA kernel may block its reductions differently for each, so logits (|x| < 1 here) differ by a few fp32 ulps
# (1.2e-7 seen on an AVX2 EPYC). A wrong block, position or mask moves them by 1e-3 or more.
LAYOUT_TOL = dict(rtol=1e-5, atol=1e-6)
# In bf16 (cuda, cpu-bf16) each stored activation is rounded to 2^-9 of itself, so the two layouts' sums part by a few
# bf16 ulps on logits below 1; 0.03 allows several and stays far below what a wrong block moves (0.1 and more).
BF16_LAYOUT_TOL = dict(rtol=0, atol=3e-2)
# Two kernels on the same decoded K/V (a gathered copy with decode_attention's softmax vs a slab with online
# softmax's exp(scores - lse), or vs SDPA): outputs (|x| < 4 here) differ by a few fp32 ulps; a wrong block, slot,
# window or encoding moves them by 1e-2 or more.
KERNEL_TOL = dict(rtol=1e-5, atol=1e-5)
SHAPE = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module", params=[4, 2], ids=["MHA", "GQA"])
def model(request) -> Decoder:
    return Decoder(tiny_config(n_kv_heads=request.param))


@pytest.fixture(scope="module")
def gqa() -> Decoder:
    return Decoder(tiny_config(n_kv_heads=2))


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    """Token ids below 13: valid for any tiny vocabulary, and small enough to be read in a failure message."""
    return torch.randint(0, 13, shape, generator=torch.Generator().manual_seed(seed))


def queries(gen: torch.Generator, batch: int, n: int) -> torch.Tensor:
    """``[B, Hkv, G=2, T, D]`` grouped queries for ``SHAPE``, scaled as the attention module scales them."""
    return torch.randn(batch, SHAPE.n_kv_heads, 2, n, SHAPE.head_dim, generator=gen) * SHAPE.head_dim**-0.5


def feed(caches: list, gen: torch.Generator, batch: int, n: int, transforms: list | None = None) -> None:
    """One step of ``n`` new tokens with the same random K/V (``[B, T, Hkv, D]``, standard normal) into every cache;
    ``transforms[i]`` maps them on their way into ``caches[i]``."""
    for cache in caches:
        cache.reserve(n)
    for layer in range(SHAPE.n_layers):
        k, v = (torch.randn(batch, n, SHAPE.n_kv_heads, SHAPE.head_dim, generator=gen) for _ in range(2))
        for cache, transform in zip(caches, transforms or [lambda x: x] * len(caches), strict=True):
            cache.append(layer, transform(k), transform(v))


def pool_state(pool: BlockPool) -> tuple:
    return (
        {s: (pool.block_table(s), pool.length(s)) for s in pool.sequences()},
        [pool.ref_count(b) for b in range(pool.n_blocks)],
        pool.free_blocks(),
        pool.n_cached,
    )


# -- paged == contiguous --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 11])  # the run ends at 33 tokens: 11 divides it, 4 does not
def test_paged_decode_equals_contiguous(model: Decoder, block_size: int, target) -> None:
    model = Decoder(model.cfg.replace(dtype=target.dtype), device=target.device)
    tol = target.tol(LAYOUT_TOL, BF16_LAYOUT_TOL)
    prompt = tokens(2, 13)
    contiguous = ContiguousKVCache.for_model(model, batch_size=2, capacity=64)
    paged = PagedKVCache.for_model(model, n_blocks=80, block_size=block_size, batch_size=2)
    expected = model.prefill(prompt, contiguous)
    torch.testing.assert_close(model.prefill(prompt, paged), expected, **tol)
    token = expected[:, -1].argmax(-1)
    for _ in range(20):
        expected = model.decode_step(token, contiguous)
        torch.testing.assert_close(model.decode_step(token, paged), expected, **tol)
        token = expected.argmax(-1)  # both caches are fed this token, so a near-tie cannot make them diverge
    assert paged.length == contiguous.length == 33
    # Layer 0's K/V come from the same projection of the same rows in both runs, before any attention, and the
    # caches store copies of them: equal bit for bit, wherever the blocks landed.
    for got, want in zip(paged.read(0), contiguous.read(0), strict=True):
        torch.testing.assert_close(got, want, **EXACT)
    # Layer 1's depend on layer 0's attention, which read the two layouts.
    for got, want in zip(paged.read(1), contiguous.read(1), strict=True):
        torch.testing.assert_close(got, want, **tol)


# -- copy-on-write ---------------------------------------------------------------------------------------------------
def test_pool_fork_copies_a_shared_block_once_when_written() -> None:
    pool = BlockPool(n_blocks=8, block_size=4)
    parent, _ = pool.add_sequence()
    pool.append([parent], 6)
    full, partial = pool.block_table(parent)
    child = pool.fork(parent)
    assert pool.ref_count(full) == pool.ref_count(partial) == 2

    grant = pool.append([child], 1)
    assert len(grant.copies) == 1 and grant.copies[0][0] == partial
    copy = grant.copies[0][1]
    assert pool.block_table(parent) == [full, partial]
    assert pool.block_table(child) == [full, copy]
    assert (pool.ref_count(full), pool.ref_count(partial), pool.ref_count(copy)) == (2, 1, 1)
    assert pool.append([parent], 1).copies == []  # the parent now holds its block alone: it writes in place


def test_cache_fork_keeps_the_parents_kv_and_matches_contiguous(gqa: Decoder) -> None:
    prompt = tokens(1, 6)
    paged = PagedKVCache.for_model(gqa, n_blocks=16, block_size=4)
    gqa.prefill(prompt, paged)
    parent_k, parent_v = (x.clone() for x in paged.read(0))
    assert paged.fork(0) == 1
    assert paged.block_tables()[0] == paged.block_tables()[1]

    next_tokens = torch.tensor([5, 17])
    logits = gqa.decode_step(next_tokens, paged)
    tables = paged.block_tables()
    assert tables[0][0] == tables[1][0] and tables[0][1] != tables[1][1]
    assert len({b for t in tables for b in t}) == 3  # the shared partial block was copied exactly once
    k, v = paged.read(0)
    # The fork shares the parent's blocks and copy-on-write copies bytes: the parent's K/V, bit for bit.
    torch.testing.assert_close(k[:, :, :6], parent_k.expand(2, -1, -1, -1), **EXACT)
    torch.testing.assert_close(v[:, :, :6], parent_v.expand(2, -1, -1, -1), **EXACT)
    assert not torch.equal(k[0, :, 6], k[1, :, 6])  # different tokens were written into the two copies

    contiguous = ContiguousKVCache.for_model(gqa, batch_size=2, capacity=16)
    gqa.prefill(prompt.expand(2, -1), contiguous)
    torch.testing.assert_close(logits, gqa.decode_step(next_tokens, contiguous), **LAYOUT_TOL)


# -- prefix caching --------------------------------------------------------------------------------------------------
def test_prefix_hit_reuses_blocks_kv_and_gives_the_remainders_logits(gqa: Decoder) -> None:
    first = tokens(1, 13, seed=1)
    paged = PagedKVCache.for_model(gqa, n_blocks=32, block_size=4)
    assert paged.begin(first) == 0
    gqa.prefill(first, paged)
    first_blocks = paged.block_tables()[0]
    first_kv = [(k.clone(), v.clone()) for k, v in (paged.read(layer) for layer in range(2))]

    second = torch.cat([first[:, :10], tokens(1, 5, seed=2)], dim=1)  # shares 10 tokens: 2 full blocks
    n_cached = paged.begin(second)
    assert n_cached == 8
    assert paged.length == 8 and paged.block_tables()[0] == first_blocks[:2]
    for layer, (k0, v0) in enumerate(first_kv):  # the hit blocks hold the bytes the first prefill wrote
        k, v = paged.read(layer)
        torch.testing.assert_close(k, k0[:, :, :8], **EXACT)
        torch.testing.assert_close(v, v0[:, :, :8], **EXACT)
    remainder = gqa.prefill(second[:, n_cached:], paged)

    # The same split on a contiguous cache: the same operations, but SDPA reads K/V through other strides.
    contiguous = ContiguousKVCache.for_model(gqa, capacity=32)
    gqa.prefill(second[:, :n_cached], contiguous)
    torch.testing.assert_close(remainder, gqa.prefill(second[:, n_cached:], contiguous), **LAYOUT_TOL)
    # A full prefill runs SDPA's is_causal path instead of the masked one, and its matmuls see 13 rows, not 5.
    fresh = ContiguousKVCache.for_model(gqa, capacity=32)
    torch.testing.assert_close(remainder, gqa.prefill(second, fresh)[:, n_cached:], **LAYOUT_TOL)


def test_prefix_hit_leaves_the_last_token_and_covers_fed_response_tokens(gqa: Decoder) -> None:
    prompt = tokens(1, 8, seed=3)
    paged = PagedKVCache.for_model(gqa, n_blocks=32, block_size=4)
    paged.begin(prompt)
    token = gqa.prefill(prompt, paged)[:, -1].argmax(-1)
    response = []
    for _ in range(5):
        response.append(int(token))
        paged.feed_tokens(token[:, None])
        token = gqa.decode_step(token, paged).argmax(-1)
    # 8 prompt tokens are cached, but a prefill needs at least one token: one block is recomputed.
    assert paged.begin(prompt) == 4
    # Next turn: prompt + response (13 tokens, whose first 12 are 3 full blocks with known ids) + a new message.
    turn_two = prompt[0].tolist() + response + [1, 2, 3]
    assert paged.begin([turn_two]) == 12


def test_a_hash_collision_is_a_miss_not_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvlab.cache.storage.block_pool.chain_hash", lambda parent_hash, block_tokens: 0)
    pool = BlockPool(n_blocks=8, block_size=2)
    a, _ = pool.add_sequence()
    pool.append([a], 4, [[1, 2, 3, 4]])
    # Both blocks hash to 0; the newer, (3, 4) after (1, 2), holds the slot. Its tokens alone match [3, 4], but
    # its K/V were computed after (1, 2), so a sequence starting with [3, 4] must not get it.
    assert pool.cached_prefix([3, 4]) == []
    assert pool.cached_prefix([1, 2, 3, 4]) == []
    b, n = pool.add_sequence([3, 4, 5, 6])
    assert n == 0 and pool.block_table(b) == []


def test_blocks_after_an_unknown_token_are_never_cached() -> None:
    pool = BlockPool(n_blocks=8, block_size=2)
    a, _ = pool.add_sequence()
    pool.append([a], 3, [[1, 2, 3]])
    pool.append([a], 1)  # an id the pool is not told: block 2's K/V depend on it
    pool.append([a], 2, [[5, 6]])
    assert pool.n_cached == 1
    assert pool.cached_prefix([1, 2, 3, 4, 5, 6]) == pool.block_table(a)[:1]
    assert pool.cached_prefix([5, 6]) == []
    with pytest.raises(ValueError, match="token_ids: allowed None, or 1 lists of 2 token ids each"):
        pool.append([a], 2, [[7]])


def test_sequences_growing_in_turn_each_keep_a_run_while_empty_blocks_allow() -> None:
    """A step reads a run of consecutive blocks in place: the allocator keeps a growing sequence's blocks one run,
    starting a second sequence mid-pool so that the first can grow into the blocks after it."""
    pool = BlockPool(n_blocks=16, block_size=2)
    a, _ = pool.add_sequence()
    b, _ = pool.add_sequence()
    for _ in range(8):
        pool.append([a, b], 1)
    for table in (pool.block_table(a), pool.block_table(b)):
        assert len(table) == 4 and table == list(range(table[0], table[0] + 4))
    full = BlockPool(n_blocks=4, block_size=2)  # no room for two runs: the blocks are still all used
    c, _ = full.add_sequence()
    d, _ = full.add_sequence()
    for _ in range(4):
        full.append([c, d], 1)
    assert sorted(full.block_table(c) + full.block_table(d)) == [0, 1, 2, 3]


def test_freed_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(n_blocks=6, block_size=2)
    a, _ = pool.add_sequence()
    pool.append([a], 4, [[1, 2, 3, 4]])
    b, _ = pool.add_sequence()
    pool.append([b], 4, [[5, 6, 7, 8]])
    a_blocks, b_blocks = pool.block_table(a), pool.block_table(b)
    pool.free(a)
    pool.free(b)
    never_used = [x for x in range(6) if x not in a_blocks + b_blocks]
    # Never-cached blocks go first, then a's (freed earlier), each sequence's tail block before its head.
    assert pool.free_blocks() == never_used + a_blocks[::-1] + b_blocks[::-1]

    again, n = pool.add_sequence([1, 2, 3, 4])  # a hit makes a's blocks the most recently used
    assert n == 4 and pool.block_table(again) == a_blocks
    pool.free(again)
    assert pool.free_blocks() == never_used + b_blocks[::-1] + a_blocks[::-1]

    c, _ = pool.add_sequence()
    pool.append([c], 6)  # three blocks: the two never cached, then b's tail
    assert sorted(pool.block_table(c)[:2]) == never_used and pool.block_table(c)[2] == b_blocks[1]
    assert pool.cached_prefix([5, 6, 7, 8]) == b_blocks[:1]
    assert pool.cached_prefix([1, 2, 3, 4]) == a_blocks
    c_blocks = pool.block_table(c)
    pool.free(c)  # its ids were never given, so its blocks hold nothing reusable: they go before any cached block
    assert sorted(pool.free_blocks()[:3]) == sorted(c_blocks)
    assert pool.free_blocks()[3:] == b_blocks[:1] + a_blocks[::-1]


# -- running out ------------------------------------------------------------------------------------------------------
def test_exhaustion_raises_a_clear_error_and_changes_nothing() -> None:
    pool = BlockPool(n_blocks=4, block_size=2)
    a, _ = pool.add_sequence()
    pool.append([a], 5, [[1, 2, 3, 4, 5]])
    b, _ = pool.add_sequence()
    before = pool_state(pool)
    with pytest.raises(PoolExhaustedError, match=r"needs 2 free block\(s\) of 2 tokens, but 1 of 4 are free") as err:
        pool.append([b], 3, [[1, 2, 3]])
    assert "preempt=True" in str(err.value) and "more blocks" in str(err.value)
    assert isinstance(err.value, CacheCapacityError)
    assert pool_state(pool) == before


def test_cache_exhaustion_keeps_the_cache_usable(gqa: Decoder) -> None:
    paged = PagedKVCache.for_model(gqa, n_blocks=3, block_size=4)
    gqa.prefill(tokens(1, 10), paged)
    before = (paged.length, paged.block_tables(), pool_state(paged.pool))
    with pytest.raises(CacheCapacityError, match="block pool exhausted"):
        gqa.prefill(tokens(1, 3), paged)
    assert (paged.length, paged.block_tables(), pool_state(paged.pool)) == before
    gqa.decode_step(torch.tensor([1]), paged)
    assert paged.length == 11


def test_preemption_frees_the_newest_other_sequences_first() -> None:
    pool = BlockPool(n_blocks=5, block_size=2)
    oldest, middle, newest = (pool.add_sequence()[0] for _ in range(3))
    pool.append([oldest], 4)
    pool.append([middle], 2)
    pool.append([newest], 2)
    assert pool.append([middle], 2, preempt=True).preempted == []  # the one free block suffices
    assert pool.append([middle], 2, preempt=True).preempted == [newest]
    assert pool.sequences() == [oldest, middle]
    before = pool_state(pool)
    with pytest.raises(PoolExhaustedError, match="even after preempting every other sequence"):
        pool.append([middle], 20, preempt=True)
    assert pool_state(pool) == before
    grant = pool.append([oldest], 4, preempt=True)
    assert grant.preempted == [middle] and pool.sequences() == [oldest]
    assert pool.length(oldest) == 8 and pool.n_free == 1
    with pytest.raises(ValueError, match="seq_id"):
        pool.free(middle)


# -- cascade ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix,suffix", [(24, 5), (8, 1), (0, 7), (16, 0)])
def test_cascade_attention_equals_per_sequence_attention(prefix: int, suffix: int) -> None:
    gen = torch.Generator().manual_seed(4)
    b, hkv, g, d = 3, 2, 2, 16
    q = torch.randn(b, hkv, g, d, generator=gen) / d**0.5
    pk, pv = torch.randn(hkv, d, prefix, generator=gen), torch.randn(hkv, prefix, d, generator=gen)
    sk, sv = torch.randn(b, hkv, d, suffix, generator=gen), torch.randn(b, hkv, suffix, d, generator=gen)
    whole_k = torch.cat([pk.expand(b, -1, -1, -1), sk], dim=-1)
    whole_v = torch.cat([pv.expand(b, -1, -1, -1), sv], dim=-2)
    expected = decode_attention(q, whole_k, whole_v)
    # Two partial softmaxes merged by log-sum-exp vs one softmax: outputs (|x| < 3) agree to a few ulps.
    torch.testing.assert_close(cascade_decode_attention(q, pk, pv, sk, sv), expected, rtol=1e-5, atol=1e-6)


def test_cascade_attention_rejects_mismatched_shapes() -> None:
    q = torch.zeros(2, 2, 1, 8)
    with pytest.raises(ValueError, match=r"prefix_v: shape \(2, 3, 8\); allowed: \(2, 4, 8\)"):
        cascade_decode_attention(
            q, torch.zeros(2, 8, 4), torch.zeros(2, 3, 8), torch.zeros(2, 2, 8, 1), torch.zeros(2, 2, 1, 8)
        )


def test_shared_prefix_blocks() -> None:
    assert shared_prefix_blocks([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert shared_prefix_blocks([[1, 2], [3, 2]]) == 0
    assert shared_prefix_blocks([]) == 0


def _shared_prompt_batch(model: Decoder, cascade: bool) -> tuple[PagedKVCache, torch.Tensor]:
    """A system prompt of 8 tokens (2 blocks of 4) served once, then three chats that start with it."""
    system = tokens(8, seed=5).tolist()
    cache = PagedKVCache.for_model(model, n_blocks=32, block_size=4, cascade=cascade)
    cache.begin([system + [1, 2, 3]])
    model.prefill(torch.tensor([system + [1, 2, 3]]), cache)
    chats = torch.tensor([system + [4, 5, 6], system + [7, 8, 9], system + [10, 11, 12]])
    assert cache.begin(chats) == 8
    return cache, model.prefill(chats[:, 8:], cache)


def test_cascade_cache_decode_matches_and_reads_the_prefix_once(gqa: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix_lengths = []

    def spy(q, prefix_k_t, *rest):
        prefix_lengths.append(prefix_k_t.shape[-1])
        return cascade_decode_attention(q, prefix_k_t, *rest)

    monkeypatch.setattr("kvlab.cache.storage.paged.cascade_decode_attention", spy)
    cascade, logits_c = _shared_prompt_batch(gqa, cascade=True)
    plain, logits_p = _shared_prompt_batch(gqa, cascade=False)
    # Prefill does not use cascade, and both caches have the same pool shape and block tables: the same kernels on
    # the same bytes through the same strides, so equal bit for bit.
    torch.testing.assert_close(logits_c, logits_p, **EXACT)
    assert prefix_lengths == []
    token = logits_p[:, -1].argmax(-1)
    for _ in range(2):
        expected = gqa.decode_step(token, plain)
        torch.testing.assert_close(gqa.decode_step(token, cascade), expected, **LAYOUT_TOL)
        token = expected.argmax(-1)
    assert prefix_lengths == [8] * 4  # 2 steps x 2 layers, each reading the 8 shared tokens once
    assert cascade.length == 13 and [t[:2] for t in cascade.block_tables()] == [cascade.block_tables()[0][:2]] * 3

    # By hand: 13 tokens = 4 blocks of 4 per sequence, the first 2 shared. One block across layers is
    # 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 tokens x 4 bytes = 2048; each layer reads each table entry it
    # uses (4 bytes).
    # cascade: 2 prefix blocks once + 3 x 2 suffix blocks = 8 blocks; 2 layers x 8 entries x 4 bytes.
    assert cascade.bytes_read_per_step() == 8 * 2048 + 2 * 8 * 4
    # per sequence: 3 x 4 = 12 blocks.
    assert plain.bytes_read_per_step() == 12 * 2048 + 2 * 12 * 4
    # Stored: 2 shared + 3 x 2 own blocks, and 12 table entries; identical for both.
    assert cascade.bytes_stored() == plain.bytes_stored() == 8 * 2048 + 12 * 4


# -- bytes -----------------------------------------------------------------------------------------------------------
def test_paged_byte_counts_by_hand(gqa: Decoder) -> None:
    paged = PagedKVCache.for_model(gqa, n_blocks=10, block_size=4)
    gqa.prefill(tokens(1, 5), paged)
    # 5 tokens take 2 blocks of 4 (the second mostly empty): 2 x 2048 bytes, plus 2 int32 table entries.
    assert paged.bytes_stored() == 2 * 2048 + 2 * 4
    # A step reads both blocks whole, and each of the 2 layers reads the 2 table entries.
    assert paged.bytes_read_per_step() == 2 * 2048 + 2 * 2 * 4
    assert paged.bytes_read_per_step(context=9) == 3 * 2048 + 2 * 3 * 4
    assert paged.bytes_allocated() == 10 * 2048
    # One new token per sequence: 2 x 2 layers x 2 heads x 16 dims x 4 bytes.
    assert paged.bytes_written_per_step() == 512
    paged.fork(0)
    assert paged.bytes_stored() == 2 * 2048 + 4 * 4  # shared blocks once, but each table pays for its entries
    paged.reset()
    assert (paged.batch_size, paged.length, paged.bytes_stored()) == (2, 0, 0)
    paged.fast_fill(9)
    assert paged.bytes_stored() == 2 * 3 * 2048 + 2 * 3 * 4


def test_bad_arguments_name_themselves(gqa: Decoder) -> None:
    with pytest.raises(ValueError, match="block_size: 0 is not allowed; allowed: an integer >= 1"):
        PagedKVCache.for_model(gqa, n_blocks=4, block_size=0)
    paged = PagedKVCache.for_model(gqa, n_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="prompts: lengths \\[3, 2\\]"):
        paged.begin([[1, 2, 3], [1, 2]])
    with pytest.raises(ValueError, match=r"index: 1 is not allowed; allowed: an integer in \[0, 0\]"):
        paged.fork(1)
    with pytest.raises(ValueError, match="token_ids: 2 rows"):
        paged.feed_tokens([[1], [2]])
    with pytest.raises(ValueError, match="n_new"):
        paged.reserve(0)


def test_constructor_sizes_the_pool_from_capacity_or_takes_n_blocks() -> None:
    sized = PagedKVCache(SHAPE, batch_size=3, capacity=10, block_size=4)
    assert sized.pool.n_blocks == 3 * 3 and sized.capacity == 10  # ceil(10 / 4) blocks per sequence
    pooled = PagedKVCache(SHAPE, n_blocks=5, block_size=4)
    assert pooled.capacity == 20  # no per-sequence cap: one sequence may fill the pool
    pooled.fast_fill(20)
    with pytest.raises(CacheCapacityError, match="block pool exhausted"):
        pooled.reserve(1)
    capped = PagedKVCache(SHAPE, capacity=6, n_blocks=8, block_size=4)
    capped.fast_fill(6)
    with pytest.raises(CacheCapacityError, match="capacity 6 per sequence"):
        capped.reserve(1)
    assert capped.length == 6
    with pytest.raises(ValueError, match="n_blocks: None with capacity None"):
        PagedKVCache(SHAPE)
    with pytest.raises(ValueError, match="cascade: 1 is not allowed"):
        PagedKVCache(SHAPE, capacity=8, cascade=1)
    with pytest.raises(ValueError, match="latent_values"):
        PagedKVCache(CacheShape(1, 1, 24, latent_values=16), capacity=8)
    with pytest.raises(ValueError, match="codec: unknown dtype 'int3'"):
        PagedKVCache(SHAPE, capacity=8, codec="int3")


# -- codecs: blocks hold the encoded bytes ----------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_paged_codec_attends_like_the_contiguous_cache_with_that_codec(codec: str) -> None:
    gen = torch.Generator().manual_seed(6)
    paged = PagedKVCache(SHAPE, batch_size=2, n_blocks=12, block_size=4, codec=codec)
    contiguous = ContiguousKVCache(SHAPE, batch_size=2, capacity=24, codec=codec)
    feed([paged, contiguous], gen, batch=2, n=9)
    q = queries(gen, 2, 9)
    for layer in range(SHAPE.n_layers):
        torch.testing.assert_close(paged.attend(layer, q), contiguous.attend(layer, q), **KERNEL_TOL)
    for _ in range(6):
        feed([paged, contiguous], gen, batch=2, n=1)
        q = queries(gen, 2, 1)
        for layer in range(SHAPE.n_layers):
            for window in (None, 6):
                got, want = paged.attend(layer, q, window), contiguous.attend(layer, q, window)
                torch.testing.assert_close(got, want, **KERNEL_TOL)
    # Each token is encoded on its own, so both hold the same codes and decode them by the same arithmetic.
    # The 9-token prefill, then one block each: the second sequence started mid-pool, so both grew in runs.
    assert paged.block_tables() == [[0, 1, 2, 3], [7, 8, 9, 10]]
    for layer in range(SHAPE.n_layers):
        for got, want in zip(paged.read(layer), contiguous.read(layer), strict=True):
            torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_paged_codec_equals_fp32_paging_of_its_decoded_kv(codec: str) -> None:
    gen = torch.Generator().manual_seed(7)
    c = get_codec(codec)

    def round_trip(x: torch.Tensor) -> torch.Tensor:  # what the store keeps of x: each token's D channels, G=32
        return c.decode(c.encode(x, -1, 32))

    coded = PagedKVCache(SHAPE, batch_size=2, capacity=16, block_size=4, codec=codec)
    decoded = PagedKVCache(SHAPE, batch_size=2, capacity=16, block_size=4)
    exact = PagedKVCache(SHAPE, batch_size=2, capacity=16, block_size=4)
    for n in (7, 1, 1, 1):
        feed([coded, decoded, exact], gen, batch=2, n=n, transforms=[lambda x: x, round_trip, lambda x: x])
    q = queries(gen, 2, 1)
    for layer in range(SHAPE.n_layers):
        for got, want in zip(coded.read(layer), decoded.read(layer), strict=True):
            torch.testing.assert_close(got, want, **EXACT)
        out = coded.attend(layer, q)
        torch.testing.assert_close(out, decoded.attend(layer, q), **KERNEL_TOL)
        if codec != "int8":
            continue
        # Against the K/V as they came: the codec's error propagated through softmax. Keys off by at most e_k move
        # each score by at most d = |q|_1 e_k, so each probability by a factor within exp(+-2d); values off by at most
        # e_v move the output by e_v. So |out - exact| <= e_v + (exp(2d) - 1) max|v| (int8 at D=16: about 0.2 here,
        # while reading a wrong token moves the output by about 1).
        (k, v), (k_raw, v_raw) = coded.read(layer), exact.read(layer)
        e_k, e_v = (k - k_raw).abs().amax(), (v - v_raw).abs().amax()
        d = q[..., 0, :].abs().sum(-1) * e_k  # [B, Hkv, G]
        bound = e_v + (torch.exp(2 * d) - 1) * v_raw.abs().amax((-2, -1))[..., None] + 1e-5
        error = (out - exact.attend(layer, q)).abs().amax((-2, -1))
        assert (error <= bound).all() and error.max() > 0, (error, bound)


@pytest.mark.parametrize(
    "codec,slot_bytes",
    # One token's 16 channels of one head: payload, plus per group of 32 channels (one here) its fp16 statistics.
    [
        ("int8", 16 + (2 + 2)),
        ("int4", 16 // 2 + (2 + 2)),
        ("fp8", 16 + 2),
        ("bf16", 16 * 2),
    ],
)
def test_paged_codec_byte_counts_by_hand(codec: str, slot_bytes: int) -> None:
    paged = PagedKVCache(SHAPE, n_blocks=10, block_size=4, codec=codec)
    block = 2 * 2 * 2 * 4 * slot_bytes  # (K, V) x 2 layers x 2 KV heads x 4 tokens x slot bytes
    assert paged.block_bytes == block
    assert paged.bytes_allocated() == 10 * block
    paged.fast_fill(5)
    assert paged.bytes_stored() == 2 * block + 2 * 4  # 2 blocks (the second partly filled), 2 int32 entries
    assert paged.bytes_read_per_step() == 2 * block + 2 * 2 * 4  # each of 2 layers reads both entries
    assert paged.bytes_written_per_step() == 2 * 2 * 2 * slot_bytes  # one token: (K, V) x layers x heads
    paged.fork(0)
    assert paged.bytes_stored() == 2 * block + 4 * 4


def test_copy_on_write_moves_the_encoded_bytes() -> None:
    gen = torch.Generator().manual_seed(8)
    paged = PagedKVCache(SHAPE, n_blocks=8, block_size=4, codec="int4")
    feed([paged], gen, batch=1, n=6)
    parent = [paged.read(layer) for layer in range(SHAPE.n_layers)]
    paged.fork(0)
    feed([paged], gen, batch=2, n=1)  # both write into the shared partial block: one of them copies it first
    assert len({b for t in paged.block_tables() for b in t}) == 3
    for layer, (k0, v0) in enumerate(parent):
        k, v = paged.read(layer)
        torch.testing.assert_close(k[:, :, :6], k0.expand(2, -1, -1, -1), **EXACT)
        torch.testing.assert_close(v[:, :, :6], v0.expand(2, -1, -1, -1), **EXACT)


# -- sliding windows -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("cascade", [False, True])
def test_windowed_decode_reads_only_the_window_with_and_without_cascade(codec: str, cascade: bool) -> None:
    gen = torch.Generator().manual_seed(9)
    paged = PagedKVCache(SHAPE, n_blocks=16, block_size=4, cascade=cascade, codec=codec)
    contiguous = ContiguousKVCache(SHAPE, batch_size=3, capacity=16, codec=codec)
    # A 10-token prompt stored once and forked into 3 sequences; the contiguous cache holds 3 copies of it.
    paged.reserve(10)
    contiguous.reserve(10)
    for layer in range(SHAPE.n_layers):
        k, v = (torch.randn(1, 10, 2, 16, generator=gen) for _ in range(2))
        paged.append(layer, k, v)
        contiguous.append(layer, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1))
    paged.fork(0)
    paged.fork(0)
    feed([paged, contiguous], gen, batch=3, n=1)
    # 11 tokens: blocks 0 and 1 (positions 0-7) shared, block 2 copied for two of the sequences on write.
    q = queries(gen, 3, 1)
    # Windows starting at 0, inside shared block 1 (position 5), and past the shared blocks (position 8).
    for window in (None, 6, 3):
        for layer in range(SHAPE.n_layers):
            got, want = paged.attend(layer, q, window), contiguous.attend(layer, q, window)
            torch.testing.assert_close(got, want, **KERNEL_TOL)
    paged.attend(0, q, 6)
    paged.attend(1, q, 3)
    # By hand, blocks of one layer: 1024 bytes (4 tokens x (K, V) x 2 heads x 16 x 4 B fp32, or 2 x 2 x 4 x 20 = 320
    # int8); 3 blocks per sequence. Layer 0 (window 6, from position 5) reads blocks 1-2: block 1 is shared, so
    # 1 + 3 x 1 with cascade, 3 x 2 without. Layer 1 (window 3, from position 8) reads block 2: 3 x 1 either way.
    layer_block = 1024 if codec == "fp32" else 320
    n_read = (4 if cascade else 6) + 3
    assert paged.bytes_read_per_step() == n_read * layer_block + n_read * 4
    # The widest window, everything: layer 0 reads 2 + 3 x 1 blocks with cascade, 3 x 3 without.
    paged.attend(0, q)
    assert paged.bytes_read_per_step() == ((5 if cascade else 9) + 3) * (layer_block + 4)


def test_a_model_with_local_layers_decodes_through_paging_as_without_a_cache() -> None:
    model = Decoder(tiny_config(layer_windows=(5, None)), device="cpu", seed=12)
    seq = tokens(2, 14, seed=10)
    paged = PagedKVCache.for_model(model, batch_size=2, capacity=16, block_size=4, cascade=True)
    logits = [model.prefill(seq[:, :8], paged)]
    logits += [model.decode_step(seq[:, i], paged)[:, None] for i in range(8, 14)]
    # The cache attends over gathered blocks with matmuls; forward runs SDPA over the whole sequence with the mask.
    torch.testing.assert_close(torch.cat(logits, dim=1), model.forward(seq), **KERNEL_TOL)


def test_a_sequence_on_consecutive_blocks_is_read_in_place_and_others_gathered(
    gqa: Decoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sequence alone in a fresh pool holds blocks 0, 1, 2, ...: its decode step reads a view of that span, and
    gives what a gather of the same K/V gives; a sequence whose blocks interleave with another's is gathered."""
    prompt = torch.arange(1, 40)[None]
    alone = PagedKVCache.for_model(gqa, 1, None, block_size=4, n_blocks=64)
    shared = PagedKVCache.for_model(gqa, 2, None, block_size=4, n_blocks=20)
    gqa.prefill(prompt, alone)
    # Every block of the second pool caches an earlier prefix, so no run is free: blocks come least recently used
    # first, a freed sequence's tail before its head, and the two sequences take them in turn.
    earlier = torch.arange(20, 100).view(2, 40)
    shared.begin(earlier)
    gqa.prefill(earlier, shared)
    shared.reset()
    for t in range(0, 39, 4):
        gqa.prefill(torch.cat([prompt[:, t : t + 4]] * 2), shared)
    shared.use(shared.seq_ids[:1])
    assert alone._run_start(alone._table) == 0 and shared._run_start(shared._table) is None
    in_place = []
    gather = PagedKVCache._gather

    def noting(self, layer, table, start, end):
        in_place.append(self._run_start(table) is not None)
        return gather(self, layer, table, start, end)

    monkeypatch.setattr(PagedKVCache, "_gather", noting)
    token = torch.tensor([5])
    torch.testing.assert_close(gqa.decode_step(token, alone), gqa.decode_step(token, shared), **LAYOUT_TOL)
    assert in_place == [True] * gqa.cfg.n_layers + [False] * gqa.cfg.n_layers


def test_a_pool_can_start_with_no_sequence(gqa):
    """batch_size=0: a server's pool before its first request, with no empty sequence to free first."""
    empty = PagedKVCache.for_model(gqa, 0, n_blocks=8, block_size=4)
    assert (empty.seq_ids, empty.batch_size, empty.bytes_stored(), empty.bytes_read_per_step()) == ([], 0, 0, 0)
    assert empty.pool.n_free == 8
    with pytest.raises(ValueError, match="^reserve: the batch has no sequence"):
        empty.reserve(1)
    started = PagedKVCache.for_model(gqa, 1, n_blocks=8, block_size=4)  # the old way: free the one it starts with
    started.free(started.seq_ids[0])
    prompt = tokens(1, 7)
    for cache in (empty, started):
        seq, _ = cache.new_sequence(prompt[0])
        cache.use([seq])
    torch.testing.assert_close(gqa.prefill(prompt, empty), gqa.prefill(prompt, started), rtol=0, atol=0)
    assert empty.block_tables() == started.block_tables()
    with pytest.raises(ValueError, match="^n_blocks: None with batch_size 0"):
        PagedKVCache(SHAPE, 0, capacity=16)
