import pytest
import torch
from torch.testing import assert_close

from kvlab import Decoder
from kvlab.cache.shared_prefix import SharedPrefixKVCache

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
    ref = model.new_cache(3, 64)
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
    assert cache.kv_bytes_per_token == per_token
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
