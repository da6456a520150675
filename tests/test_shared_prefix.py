import pytest
import torch
from torch.testing import assert_close

from kvlab import Decoder
from kvlab.cache.base import CacheShape
from kvlab.cache.storage.shared_prefix import SharedPrefixKVCache
from kvlab.cache.storage.slab import ContiguousKVCache

from .helpers import tiny_config


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_shared_prefix_decode_equals_each_sequence_with_its_own_copy(n_kv_heads):
    model = Decoder(tiny_config(n_kv_heads=n_kv_heads), device="cpu")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 101, (1, 23), generator=g)
    own = torch.randint(0, 101, (3, 4), generator=g)  # each sequence's own prompt after the shared one
    steps = torch.randint(0, 101, (3, 10), generator=g)

    shared = SharedPrefixKVCache.for_model(model, batch_size=3, capacity=64)
    model.prefill(prompt, shared)
    shared.branch()
    ref = ContiguousKVCache.for_model(model, 3, 64)
    model.prefill(prompt.expand(3, -1), ref)
    # The shared cache prefills over a concatenated copy and decodes by merging the prefix's and each suffix's
    # partial softmax (log-sum-exp); the reference reads one slab per sequence. Other sums in another order: logits
    # (|x| < 1) agree to a few ulps, while reading another sequence's tokens or a wrong position moves them by far more.
    assert_close(model.prefill(own, shared), model.prefill(own, ref), rtol=0, atol=1e-5)
    for t in range(steps.shape[1]):
        assert_close(model.decode_step(steps[:, t], shared), model.decode_step(steps[:, t], ref), rtol=0, atol=1e-5)
    k, v = shared.read(1)
    # The prefix was computed once at batch 1, the reference's at batch 3: matmuls of other shapes, to rounding.
    assert_close(k, ref.read(1)[0], rtol=0, atol=1e-6)
    assert shared.length == ref.length == 23 + 4 + 10


def test_bytes_count_the_prefix_once_for_the_batch():
    model = Decoder(tiny_config(), device="cpu")
    cache = SharedPrefixKVCache.for_model(model, batch_size=5, capacity=100)
    cache.fast_fill(40)
    cache.branch()
    cache.fast_fill(7)
    per_token = 2 * 2 * 2 * 16 * 4  # K+V, layers, KV heads, head dim, fp32
    assert cache.bytes_per_token == per_token
    assert cache.bytes_read_per_step() == (40 + 5 * 7) * per_token
    assert cache.bytes_stored() == (40 + 5 * 7) * per_token
    assert cache.bytes_read_per_step(context=30) == 30 * per_token  # inside the prefix: all shared


def test_branching_rules():
    model = Decoder(tiny_config(), device="cpu")
    cache = SharedPrefixKVCache.for_model(model, batch_size=2, capacity=16)
    with pytest.raises(RuntimeError, match="prefix is empty"):
        cache.branch()
    model.prefill(torch.zeros(1, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="batch"):
        model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    cache.branch()
    with pytest.raises(RuntimeError, match="already branched"):
        cache.branch()
    model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    cache.reset()
    assert cache.batch_size == 1 and cache.length == 0
    with pytest.raises(ValueError, match="batch_size"):
        SharedPrefixKVCache.for_model(model, batch_size=0, capacity=16)


SHAPE = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)


def _kv(gen: torch.Generator, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, random K and V ``[B, T, Hkv, D]``."""
    return [tuple(torch.randn(batch, n, 2, 16, generator=gen) for _ in range(2)) for _ in range(SHAPE.n_layers)]


def _store(cache, kv) -> None:
    cache.reserve(kv[0][0].shape[1])
    for layer, (k, v) in enumerate(kv):
        cache.append(layer, k, v)


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4"])
def test_shared_prefix_with_a_codec_and_windows_attends_like_a_contiguous_cache_with_that_codec(codec):
    gen = torch.Generator().manual_seed(1)
    shared = SharedPrefixKVCache(SHAPE, batch_size=3, capacity=24, codec=codec)
    ref = ContiguousKVCache(SHAPE, batch_size=3, capacity=24, codec=codec)
    prompt = _kv(gen, 1, 10)
    _store(shared, prompt)
    _store(ref, [(k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)) for k, v in prompt])
    shared.branch()
    for n in (3, 1, 1):  # each sequence's own prompt, then two decode steps
        kv = _kv(gen, 3, n)
        _store(shared, kv)
        _store(ref, kv)
        q = torch.randn(3, 2, 2, n, 16, generator=gen) / 4  # [B, Hkv, G, T, D], scaled by 1/sqrt(16)
        # Windows reaching into the prefix, starting at its end (position 10), and inside the suffix.
        for window in (None, 6, shared.length - 10, 2):
            for layer in range(SHAPE.n_layers):
                # Both decode the same codes (each token is encoded alone); the shared cache merges the prefix's
                # and each suffix's partial softmax, the reference runs one softmax (or online softmax): a few ulps.
                got, want = shared.attend(layer, q, window), ref.attend(layer, q, window)
                assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer in range(SHAPE.n_layers):
        for got, want in zip(shared.read(layer), ref.read(layer), strict=True):
            assert_close(got, want, rtol=0, atol=0)  # copies of the same decoded bytes


def test_int8_bytes_by_hand_and_windows_bound_the_read():
    cache = SharedPrefixKVCache(SHAPE, batch_size=4, capacity=64, codec="int8")
    # One token: (K, V) x 2 layers x 2 KV heads x (16 int8 codes + one group of 32 channels' fp16 scale and zero).
    per_token = 2 * 2 * 2 * (16 + 2 + 2)
    assert cache.bytes_per_token == per_token
    cache.fast_fill(20)
    cache.branch()
    cache.fast_fill(5)
    assert cache.bytes_stored() == (20 + 4 * 5) * per_token
    assert cache.bytes_read_per_step() == (20 + 4 * 5) * per_token
    q = torch.zeros(4, 2, 2, 1, 16)
    cache.attend(0, q, 8)  # layer 0: positions 17-24, 3 of them in the prefix, 5 each sequence's own
    cache.attend(1, q, 3)  # layer 1: positions 22-24, all each sequence's own
    per_layer = per_token // 2
    assert cache.bytes_read_per_step() == ((3 + 4 * 5) + 4 * 3) * per_layer
