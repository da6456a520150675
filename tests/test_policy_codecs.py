"""Policies composed with codecs: a window or H2O cache storing int8/int4/fp8 equals the same policy in fp32 fed
the K/V that codec would give back, and counts the bytes it really stores.

The caches are driven directly (reserve, append, attend) with random K/V and queries, so each layer sees exactly
the same inputs in both caches: the comparison is of one attention over the same dequantized numbers, by the
encoded path (chunked online softmax, or a decoded step view) and the float path (views and one softmax).
"""

import functools

import pytest
import torch
from torch.testing import assert_close

from kvlab import Decoder
from kvlab.cache.base import CacheShape
from kvlab.cache.codec.codecs import get_codec
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.cache.policy.window import WindowKVCache
from kvlab.model.attention import rotated
from kvlab.model.layers import RotaryEmbedding
from tests.helpers import tiny_config

SHAPE = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)
B, G, N = 2, 2, 40
SCHEDULE = [10] + [1] * 14 + [5] + [1] * 11  # a prefill past the windows, decode steps, a chunk, decode steps
ROPE = RotaryEmbedding(SHAPE.head_dim, 10000.0)
# Two kernels over the same fp32 numbers (online softmax by chunks against one softmax, or the same softmax over
# differently ordered keys): a few ulps of outputs of size ~1.
TOL = dict(rtol=1e-5, atol=1e-5)


def dequantized(codec: str):
    """What a store of ``codec`` gives back for K/V ``[B, T, Hkv, D]``: each token's head encoded on its own."""
    c = get_codec(codec)
    return lambda x: c.decode(c.encode(x, -1, 32)).to(x.dtype)


def drive(cache, window=None, schedule=SCHEDULE, kv=lambda x: x, seed=0) -> torch.Tensor:
    """Feed random K/V (through ``kv``) and queries by ``schedule``; every layer's attention output, concatenated
    over steps: ``[layers, B, Hkv, G, N, D]``. ``window``: the model layer's own sliding window."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = SHAPE.n_kv_heads, SHAPE.head_dim
    outs = [[] for _ in range(SHAPE.n_layers)]
    for t in schedule:
        cache.reserve(t)
        for layer in range(SHAPE.n_layers):
            k, v = (2 * torch.randn(B, t, hkv, d, generator=gen) for _ in range(2))
            q = 2 * torch.randn(B, hkv, G, t, d, generator=gen) * d**-0.5
            cache.append(layer, kv(k), kv(v))
            outs[layer].append(cache.attend(layer, q, window, functools.partial(rotated, q, ROPE)))
    return torch.stack([torch.cat(o, dim=-2) for o in outs])


WINDOWS = {
    "window+sinks": (dict(window=6, sinks=2), None),
    "reassigned": (dict(window=6, sinks=2, positions="reassigned"), None),
    # The model layer's window (4) is shorter than what the cache keeps: masked by position, decode included.
    "model-window": (dict(window=8, sinks=2), 4),
}


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("case", WINDOWS)
def test_window_with_a_codec_equals_the_fp32_window_over_dequantized_kv(codec, case):
    options, window = WINDOWS[case]
    got = drive(WindowKVCache(SHAPE, B, codec=codec, **options), window)
    want = drive(WindowKVCache(SHAPE, B, **options), window, kv=dequantized(codec))
    assert_close(got, want, **TOL)
    # The codec is really applied: raw fp32 K/V give other outputs.
    assert (got - drive(WindowKVCache(SHAPE, B, **options), window)).abs().max() > 1e-3


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_heavy_hitters_with_a_codec_equal_fp32_heavy_hitters_over_dequantized_kv(codec):
    cache, reference = (HeavyHitterKVCache(SHAPE, B, heavy=3, recent=4, codec=c) for c in (codec, "fp32"))
    assert_close(drive(cache), drive(reference, kv=dequantized(codec)), **TOL)
    for layer in range(SHAPE.n_layers):  # the same decisions, and the same K/V in each kept slot
        positions = cache.kept_positions(layer)
        assert torch.equal(positions.sort(-1).values, reference.kept_positions(layer).sort(-1).values)
        order, reference_order = positions.argsort(-1), reference.kept_positions(layer).argsort(-1)
        for got, want in zip(cache.read(layer), reference.read(layer), strict=True):
            index = order[..., None].expand_as(got)
            assert_close(got.gather(2, index), want.gather(2, reference_order[..., None].expand_as(want)), **TOL)


def test_a_float_codec_below_the_arriving_dtype_is_a_cast():
    """fp16 storage of fp32 K/V: the same as fp32 storage of K/V cast to fp16 and back."""
    got = drive(HeavyHitterKVCache(SHAPE, B, heavy=3, recent=4, codec="fp16"))
    want = drive(HeavyHitterKVCache(SHAPE, B, heavy=3, recent=4), kv=lambda x: x.half().float())
    assert_close(got, want, **TOL)
    got = drive(WindowKVCache(SHAPE, B, window=6, sinks=2, codec="bf16"))
    assert_close(got, drive(WindowKVCache(SHAPE, B, window=6, sinks=2), kv=lambda x: x.bfloat16().float()), **TOL)


# -- bytes, against hand counts (head dim 16, group size 32: one group per token, head and K or V) ----------------
SLOT_BYTES = {
    "int8": 16 + 2 + 2,  # 16 one-byte codes + an fp16 scale + an fp16 zero point
    "int4": 16 // 2 + 2 + 2,  # two codes per byte
    "fp8": 16 + 2,  # e4m3 codes + an fp16 scale (symmetric: no zero point)
}


@pytest.mark.parametrize("codec", SLOT_BYTES)
def test_window_bytes_with_a_codec_match_a_hand_count(codec):
    cache = WindowKVCache(SHAPE, B, codec=codec, window=6, sinks=2)
    drive(cache)
    per_token = 2 * 2 * SLOT_BYTES[codec]  # K and V x 2 KV heads, one layer
    layers, kept = 2, 2 + 6
    assert cache.bytes_stored() == B * layers * kept * per_token
    assert cache.bytes_read_per_step() == B * layers * kept * per_token
    assert cache.bytes_read_per_step(5) == B * layers * 5 * per_token
    assert cache.bytes_written_per_step() == B * layers * per_token
    assert cache.bytes_allocated() == B * layers * kept * per_token
    assert cache.element_bytes == SLOT_BYTES[codec] / 16


def test_heavy_hitter_bytes_with_int8_match_a_hand_count():
    cache = HeavyHitterKVCache(SHAPE, B, heavy=3, recent=4, codec="int8")
    drive(cache)
    kv = 2 * 2 * (16 + 2 + 2)  # one token's K and V in one layer: 2 KV heads x (16 codes + fp16 scale and zero)
    layers, heads, budget, score, position = 2, 2, 7, 4, 8  # fp32 score and int64 position per slot and KV head
    assert cache.bytes_stored() == B * layers * budget * (kv + heads * (score + position))
    kept_read = B * layers * heads * budget * score  # the scores a step adds to
    evict_read = B * layers * heads * budget * (score + position)  # every slot's, to choose the evicted one
    assert cache.bytes_read_per_step() == B * layers * budget * kv + kept_read + evict_read
    assert cache.bytes_allocated() == B * layers * budget * (kv + heads * (score + position))


@pytest.mark.parametrize("codec", SLOT_BYTES)
def test_a_windowed_model_decodes_through_its_own_cache_and_h2o_in_any_codec(codec):
    model = Decoder(tiny_config(layer_windows=(4, None)), device="cpu")  # 2 KV heads of 16, like SHAPE
    tokens = torch.randint(0, model.cfg.vocab_size, (B, 24), generator=torch.Generator().manual_seed(0))
    per_token = 2 * 2 * SLOT_BYTES[codec]  # K and V x 2 KV heads, one layer
    window = model.new_cache(B, 24, kv_dtype=codec)
    h2o = HeavyHitterKVCache.for_model(model, B, heavy=3, recent=4, codec=codec)
    for cache in (window, h2o):
        logits = model.prefill(tokens[:, :10], cache)
        for t in range(10, 24):
            logits = model.decode_step(tokens[:, t], cache)
        assert torch.isfinite(logits).all()
    assert isinstance(window, WindowKVCache) and window.codec == codec
    assert window.bytes_stored() == B * (4 + 24) * per_token  # the local layer holds its window, the global all
    assert h2o.bytes_stored() == B * 2 * 7 * (per_token + 2 * (4 + 8))  # + fp32 score, int64 position per head
