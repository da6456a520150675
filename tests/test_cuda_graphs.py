"""The static-shape cache gives the contiguous cache's logits, eagerly everywhere; its CUDA graph replays them."""

import pytest
import torch
from torch.testing import assert_close

from kvlab import CacheCapacityError, Decoder
from kvlab.cache import CacheShape
from kvlab.cache.storage.slab import StaticKVCache
from kvlab.engine.cuda_graphs import GraphedDecodeStep

from .helpers import assert_greedy_picks, tiny_config

# The static step masks the unwritten slots and sums over all `capacity` of them, the contiguous one slices to the
# length: the same products in another order, a few fp32 ulps on logits below 1. bf16 rounds every stored
# activation to 8 bits (2^-9 of itself), so two orders of bf16 sums part by a few of its ulps at 0.5-1: 0.004
# seen on CPU over 30 positions, 0.02 allows several. A position off by one or a mask letting a later slot in
# moves logits by 0.1 or more (the window case, before it was right).
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=0, atol=2e-2)


def _stream(model: Decoder, cache, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    out = [model.prefill(tokens[:, :prefill], cache)]
    out += [model.decode_step(tokens[:, t], cache)[:, None] for t in range(prefill, tokens.shape[1])]
    return torch.cat(out, dim=1).float()


@pytest.mark.parametrize("windows", [None, (5, None)], ids=["global", "local-global"])
def test_static_cache_gives_the_contiguous_caches_logits(target, windows):
    model = Decoder(tiny_config(dtype=target.dtype, layer_windows=windows), device=target.device)
    tokens = torch.randint(0, 101, (3, 30), generator=torch.Generator().manual_seed(1)).to(target.device)
    want = _stream(model, model.new_cache(3, 30), tokens, 7)
    got = _stream(model, StaticKVCache.for_model(model, 3, 40), tokens, 7)
    assert_close(got, want, **target.tol(FP32_TOL, BF16_TOL))


def test_the_step_has_one_shape_and_counts_every_slot():
    model = Decoder(tiny_config(), device="cpu")
    cache = StaticKVCache.for_model(model, 2, 16)
    assert cache.bytes_allocated() == 2 * 16 * cache.bytes_per_token
    model.prefill(torch.zeros(2, 5, dtype=torch.long), cache)
    model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    assert cache.length == 6 and cache._start.tolist() == [5]
    # Whatever the length, a step reads all 16 slots: that is what a static shape costs.
    assert cache.bytes_read_per_step() == cache.bytes_read_per_step(context=1) == 2 * 16 * cache.bytes_per_token
    k, v = cache.read(0)
    assert k.shape == v.shape == (2, model.cfg.n_kv_heads, 6, model.cfg.head_dim)


def test_capacity_rollback_and_reset():
    model = Decoder(tiny_config(), device="cpu")
    tokens = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(2))
    cache = StaticKVCache.for_model(model, 1, 10)
    model.prefill(tokens[:, :8], cache)
    with pytest.raises(CacheCapacityError, match="8 tokens stored, 3 more requested, capacity 10"):
        model.prefill(tokens[:, :3], cache)
    assert cache.length == 8
    # Forgetting the last 3 and feeding them again gives the logits they gave the first time.
    first = model.decode_step(tokens[:, 8], cache)
    cache.truncate(8)
    assert_close(model.decode_step(tokens[:, 8], cache), first, rtol=0, atol=0)
    cache.reset()
    assert cache.length == 0 and cache._end.tolist() == [0]


def test_bad_arguments_name_the_field():
    shape = CacheShape(n_layers=1, n_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="codec: 'int8'; allowed: fp32, fp16, bf16"):
        StaticKVCache(shape, 1, 8, codec="int8")
    with pytest.raises(ValueError, match="capacity: None"):
        StaticKVCache(shape, 1)
    model = Decoder(tiny_config(), device="cpu")
    with pytest.raises(ValueError, match="model: on cpu; allowed: a model on a CUDA device"):
        GraphedDecodeStep(model, StaticKVCache.for_model(model, 1, 8))


@pytest.mark.gpu
def test_the_replayed_graph_gives_the_eager_static_steps_logits():
    model = Decoder(tiny_config(dtype="bf16"), device="cuda")
    tokens = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(3)).cuda()
    eager, graphed = StaticKVCache.for_model(model, 2, 32), StaticKVCache.for_model(model, 2, 32)
    model.prefill(tokens[:, :8], eager)
    model.prefill(tokens[:, :8], graphed)
    step = GraphedDecodeStep(model, graphed)
    assert graphed.length == 8  # warm-up and recording rolled back
    for t in range(8, 24):
        # The same kernels on the same buffers: the replay is the eager step, bit for bit.
        assert torch.equal(step(tokens[:, t]), model.decode_step(tokens[:, t], eager))
    assert graphed.length == eager.length == 24
    with pytest.raises(CacheCapacityError):
        for t in range(8):
            step(tokens[:, t])


@pytest.mark.gpu
def test_greedy_decoding_through_the_graph_picks_the_full_forwards_argmax():
    model = Decoder(tiny_config(dtype="bf16"), device="cuda")
    prompt = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(4)).cuda()
    cache = StaticKVCache.for_model(model, 2, 32)
    token = model.prefill(prompt, cache)[:, -1].argmax(-1)
    step, out = GraphedDecodeStep(model, cache), [token]
    for _ in range(9):
        out.append(step(out[-1]).argmax(-1))
    new = torch.stack(out, dim=1)
    with torch.no_grad():
        assert_greedy_picks(new, model(torch.cat([prompt, new], dim=1))[:, 5:-1].float(), **BF16_TOL)
