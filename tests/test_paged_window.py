"""Window + sinks on the paged cache: logits equal the contiguous window cache's (original positions), blocks that
hold no kept token go back to the pool, bytes follow the roofline's keep rule up to block rounding, no rollback."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from kvlab.cache.base import CacheRollbackError, CacheShape
from kvlab.cache.policy.window import WindowKVCache
from kvlab.cache.storage.block_pool import HOLE, BlockPool
from kvlab.cache.storage.paged import TABLE_ENTRY_BYTES, PagedKVCache
from kvlab.engine.speculative import speculative_generate
from kvlab.model.decoder import Decoder
from kvlab.roofline import kv_bytes_per_step

from .helpers import tiny_config

# Two kernels on the same K/V: a masked softmax over gathered whole blocks vs the window cache's slots (in ring
# order, or its own masked view). Logits (|x| < 1) differ by a few fp32 ulps; a wrong slot, position or mask moves
# them by 1e-3 or more.
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)
SHAPE = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)
CHUNKS = (7, 5, 7)  # the prompt, prefilled a chunk at a time: the later chunks evict tokens their first queries see


def blocks_bound(window: int, sinks: int, block_size: int) -> int:
    """The most blocks one windowed sequence holds: the sinks', the window's, and one the window straddles."""
    return math.ceil(sinks / block_size) + math.ceil(window / block_size) + 1


def held(cache: PagedKVCache) -> int:
    return cache.pool.n_blocks - cache.pool.n_free


def run(model: Decoder, cache, prompt: torch.Tensor, follow: torch.Tensor) -> torch.Tensor:
    """Logits ``[T + N, V]``: the prompt prefilled in ``CHUNKS``, then ``follow`` (``[N]``) decoded one by one."""
    logits, done = [], 0
    for n in CHUNKS:
        logits.append(model.prefill(prompt[None, done : done + n], cache)[0])
        done += n
    logits += [model.decode_step(token[None], cache) for token in follow]
    return torch.cat(logits)


@pytest.mark.parametrize(
    ("block_size", "window", "sinks"),
    [(4, 8, 4), (3, 7, 2), (5, 6, 0), (4, 5, 9)],
    ids=["divides", "does-not-divide", "no-sinks", "sinks-over-window"],
)
@pytest.mark.parametrize("layer_windows", [None, (4, None)], ids=["global-layers", "local-layer"])
def test_logits_equal_the_window_cache_with_original_positions(
    block_size: int, window: int, sinks: int, layer_windows: tuple | None
) -> None:
    model = Decoder(tiny_config(layer_windows=layer_windows), device="cpu", seed=5)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 101, (sum(CHUNKS),), generator=gen)
    follow = torch.randint(0, 101, (3 * window,), generator=gen)  # decoded past several windows
    paged = PagedKVCache.for_model(model, n_blocks=32, block_size=block_size, window=window, sinks=sinks)
    reference = WindowKVCache.for_model(model, window=window, sinks=sinks, positions="original")
    torch.testing.assert_close(run(model, paged, prompt, follow), run(model, reference, prompt, follow), **LOGITS_TOL)
    assert held(paged) <= blocks_bound(window, sinks, block_size)


def test_a_long_chunk_attends_a_block_of_queries_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Decoder(tiny_config(), device="cpu", seed=5)
    gen = torch.Generator().manual_seed(8)
    prompt, follow = torch.randint(0, 101, (sum(CHUNKS),), generator=gen), torch.randint(0, 101, (6,), generator=gen)
    whole = run(model, PagedKVCache.for_model(model, n_blocks=16, block_size=4, window=6, sinks=2), prompt, follow)
    monkeypatch.setattr("kvlab.cache.storage.paged.MAX_SCORES", 160)  # one query per block: 4 heads x ~27 slots each
    cache = PagedKVCache.for_model(model, n_blocks=16, block_size=4, window=6, sinks=2)
    torch.testing.assert_close(run(model, cache, prompt, follow), whole, **LOGITS_TOL)
    # read() returns the kept tokens in position order: the window cache's slots, sorted by position.
    reference = WindowKVCache.for_model(model, window=6, sinks=2)
    run(model, reference, prompt, follow)
    order = reference.kept_positions(0)[0, 0].argsort()
    for got, want in zip(cache.read(0), reference.read(0), strict=True):
        torch.testing.assert_close(got, want[:, :, order], rtol=0, atol=0)


def test_int8_composes_with_the_window() -> None:
    model = Decoder(tiny_config(), device="cpu", seed=5)
    gen = torch.Generator().manual_seed(7)
    prompt, follow = torch.randint(0, 101, (sum(CHUNKS),), generator=gen), torch.randint(0, 101, (12,), generator=gen)
    paged = PagedKVCache.for_model(model, n_blocks=16, block_size=4, window=6, sinks=2, codec="int8")
    reference = WindowKVCache.for_model(model, window=6, sinks=2, codec="int8")
    torch.testing.assert_close(run(model, paged, prompt, follow), run(model, reference, prompt, follow), **LOGITS_TOL)
    assert paged.block_bytes < PagedKVCache.for_model(model, n_blocks=16, block_size=4, window=6).block_bytes / 3


def test_a_ragged_batch_decodes_each_row_as_alone() -> None:
    model = Decoder(tiny_config(), device="cpu", seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 101, (1, n), generator=gen) for n in (9, 4, 13)]
    follow = torch.randint(0, 101, (3, 8), generator=gen)
    cache = PagedKVCache.for_model(model, n_blocks=24, block_size=4, window=5, sinks=2)
    ids = []
    for prompt in prompts:
        ids.append(cache.new_sequence()[0])
        cache.use([ids[-1]])
        model.prefill(prompt, cache)
    cache.use(ids)
    logits = torch.stack([model.decode_step(follow[:, i], cache) for i in range(8)], dim=1)  # [3, 8, V]
    assert cache.lengths == [17, 12, 21]
    for row, prompt in enumerate(prompts):
        alone = WindowKVCache.for_model(model, window=5, sinks=2)
        model.prefill(prompt, alone)
        want = torch.stack([model.decode_step(follow[row : row + 1, i], alone)[0] for i in range(8)])
        torch.testing.assert_close(logits[row], want, **LOGITS_TOL)
    assert all(len([b for b in t if b != HOLE]) <= blocks_bound(5, 2, 4) for t in cache.block_tables())


def test_blocks_go_back_to_the_pool_and_memory_stays_bounded() -> None:
    window, sinks, size = 8, 3, 4
    bound = blocks_bound(window, sinks, size)
    cache = PagedKVCache(SHAPE, n_blocks=bound + 3, block_size=size, window=window, sinks=sinks)
    k = v = torch.ones(1, 1, SHAPE.n_kv_heads, SHAPE.head_dim)
    for step in range(300):  # 75 blocks' worth of tokens through a pool of `bound + 3` blocks
        cache.reserve(1)
        for layer in range(SHAPE.n_layers):
            cache.append(layer, k, v)
        assert held(cache) <= bound, step
    table = cache.block_tables()[0]
    assert table[0] != HOLE and HOLE in table[1:-2]  # the sinks' block stays, the ones after it went back
    assert cache.bytes_stored() <= bound * (cache.block_bytes + TABLE_ENTRY_BYTES)
    cache.reserve(10)  # a multi-token step frees what its first query no longer sees, before it allocates
    assert held(cache) <= math.ceil(sinks / size) + math.ceil((window - 1 + 10) / size) + 1
    cache.reset()
    assert cache.pool.n_free == cache.pool.n_blocks


def test_shared_and_cached_blocks_follow_the_pools_refcounts() -> None:
    model = Decoder(tiny_config(), device="cpu", seed=2)
    prompt = list(range(1, 17))  # four full blocks of 4, registered for prefix caching
    cache = PagedKVCache.for_model(model, n_blocks=24, block_size=4, window=4)
    assert cache.begin([prompt]) == 0
    model.prefill(torch.tensor([prompt]), cache)
    cache.fork(0)  # the copy shares every block
    cache.use([cache.seq_ids[0]])
    shared = cache.block_tables()[0][1]
    for token in range(8):
        model.decode_step(torch.tensor([token]), cache)
    assert cache.block_tables()[0][1] == HOLE
    assert cache.pool.ref_count(shared) == 1  # the fork still holds (and may read) it
    assert cache.pool.n_cached >= 4
    # The prompt's blocks are still registered; a new batch hits them (all but the last, which must prefill).
    assert cache.begin([prompt]) == 12
    model.prefill(torch.tensor([prompt[12:]]), cache)  # the first step gives back the hits its window left behind
    assert cache.block_tables()[0][:2] == [HOLE, HOLE]


def test_bytes_read_follow_the_roofline_up_to_block_rounding() -> None:
    model = Decoder(tiny_config(), device="cpu", seed=0)
    cfg, size, window, sinks = model.cfg, 4, 10, 3
    cache = PagedKVCache.for_model(model, n_blocks=8, block_size=size, window=window, sinks=sinks)
    layer_token_bytes = cache.block_bytes // (size * cfg.n_layers)
    # Per layer, whole blocks overshoot the sinks by < size tokens and the window (which may straddle a block
    # boundary at each end) by < 2 * size; each block read also reads its 4-byte table entry.
    entries = blocks_bound(window, sinks, size)
    slack = cfg.n_layers * (3 * (size - 1) * layer_token_bytes + entries * TABLE_ENTRY_BYTES)
    for context in range(1, 80):
        roofline = kv_bytes_per_step(cfg, context, window=window, sinks=sinks)
        paged = cache.bytes_read_per_step(context)
        assert 0 <= paged - roofline <= slack, context
    assert cache.bytes_read_per_step(1000) == cache.bytes_read_per_step(2000)  # flat however long it grows


def test_a_windowed_cache_refuses_rollback_and_speculative_decoding() -> None:
    model = Decoder(tiny_config(), device="cpu", seed=0)
    cache = PagedKVCache(SHAPE, n_blocks=8, block_size=4, window=4)
    assert not cache.can_roll_back(1) and cache.max_rollback == 0
    cache.fast_fill(6)
    with pytest.raises(CacheRollbackError, match="cannot roll back"):
        cache.truncate(5)
    assert PagedKVCache(SHAPE, n_blocks=8).can_roll_back(1)  # the class default is untouched
    make_cache = functools.partial(PagedKVCache.for_model, n_blocks=16, window=8)
    with pytest.raises(CacheRollbackError, match="PagedKVCache cannot roll back"):
        speculative_generate(model, [1, 2, 3], 4, draft=model, make_cache=make_cache)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(sinks=4), "sinks: 4 without a window"),
        (dict(window=0), "window"),
        (dict(window=-3), "window"),
        (dict(window=8, sinks=-1), "sinks"),
        (dict(window=8, cascade=True), "cascade: True with a window"),
    ],
)
def test_bad_window_options_name_themselves(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PagedKVCache(SHAPE, n_blocks=8, **options)


def test_the_pool_releases_a_full_block_into_a_hole_and_refuses_the_rest() -> None:
    pool = BlockPool(n_blocks=6, block_size=4)
    seq, _ = pool.add_sequence()
    pool.append([seq], 10)  # blocks 0, 1 full; 2 partly filled
    child = pool.fork(seq)
    first = pool.block_table(seq)[1]
    pool.release_block(seq, 1)
    assert pool.block_table(seq)[1] == HOLE and pool.ref_count(first) == 1  # the fork still holds it
    pool.release_block(seq, 1)  # a hole again: nothing changes
    with pytest.raises(ValueError, match=r"index: 2 is not allowed; allowed: an integer in \[0, 1\]"):
        pool.release_block(seq, 2)  # the next write goes there
    with pytest.raises(ValueError, match="length: 9; allowed: at most 4"):
        pool.truncate(seq, 9)
    pool.free(child)
    pool.free(seq)
    assert pool.n_free == 6


def test_releasing_what_a_window_passed_walks_back_to_the_first_hole() -> None:
    pool = BlockPool(n_blocks=8, block_size=4)
    seq, _ = pool.add_sequence()
    pool.append([seq], 21)  # blocks 0-4 full, 5 partly filled
    pool.release_block(seq, 1)  # released on an earlier step
    assert pool.release_gone(seq, range(1, 4))  # 3 and 2 go back; the walk stops at the hole at 1
    assert pool.block_table(seq)[:5] == [pool.block_table(seq)[0], HOLE, HOLE, HOLE, pool.block_table(seq)[4]]
    assert not pool.release_gone(seq, range(1, 4))  # nothing left to give back
    assert pool.n_free == 8 - 3
