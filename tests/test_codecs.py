"""KV codecs and the quantized cache: error bounds, byte counts by hand, and the attention paths against each other."""

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from kvlab import ContiguousKVCache, Decoder
from kvlab.cache.base import CacheShape
from kvlab.cache.codec.codecs import CODECS, IntCodec, get_codec, pack_codes, unpack_codes
from kvlab.cache.codec.kivi import QuantizedKVCache, codec_error
from kvlab.kernels.int8 import folded_value_product, int8_key_scores

from .helpers import tiny_config

TOKENS, CHANNELS = 2, 3  # dims of a [B, Hkv, S, D] tensor


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _per_element(stat: torch.Tensor, dim: int, group_size: int, n: int) -> torch.Tensor:
    """A per-group statistic repeated over its group's elements."""
    return stat.float().repeat_interleave(group_size, dim=dim).narrow(dim, 0, n)


# -- codecs --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "int1"])
@pytest.mark.parametrize("dim", [TOKENS, CHANNELS], ids=["per-channel", "per-token"])
@pytest.mark.parametrize("group_size", [8, 5, 64], ids=["G8", "ragged-G5", "G-longer-than-dim"])
@pytest.mark.parametrize(("spread", "offset"), [(3.0, 1.0), (0.05, 60.0)], ids=["wide", "narrow-far-from-0"])
def test_int_codecs_err_by_at_most_half_a_scale(name, dim, group_size, spread, offset):
    # 37 tokens and 10 channels: odd, and no multiple of the group sizes. A narrow range far from zero is where
    # an fp16 zero point rounded the wrong way would clip a whole group.
    x = _randn(2, 3, 37, 10) * spread + offset
    codec = get_codec(name)
    enc = codec.encode(x, dim, group_size)
    scale = _per_element(enc.scale, dim, group_size, x.shape[dim])
    err = (codec.decode(enc) - x).abs()
    # Half a quantization step, plus fp32's own rounding of a result as large as x (a couple of ulps).
    bound = scale / 2 + x.abs() * 2**-22
    assert torch.all(err <= bound), f"max error / scale = {(err / scale).max():.4f} > 0.5"
    # The bound is not loose: rounding to the nearest code leaves errors close to half a step.
    assert (err / scale).max() > 0.45


@pytest.mark.parametrize("dim", [TOKENS, CHANNELS])
def test_fp8_error_is_e4m3_rounding_of_the_scaled_value(dim):
    x = _randn(2, 3, 37, 10, seed=1) * 4
    codec = get_codec("fp8")
    enc = codec.encode(x, dim, 8)
    scale = _per_element(enc.scale, dim, 8, x.shape[dim])
    err = (codec.decode(enc) - x).abs()
    # e4m3 keeps 3 mantissa bits: a normal value rounds within 1/16 of itself, a subnormal within 2^-10 (scaled).
    assert torch.all(err <= x.abs() / 16 + scale / 1024 + 1e-6)
    assert enc.zero is None


@pytest.mark.parametrize(("name", "rtol"), [("fp32", 0.0), ("fp16", 2**-11), ("bf16", 2**-8)])
def test_float_codecs_are_casts(name, rtol):
    x = _randn(3, 37, 10, seed=2) * 5
    enc = get_codec(name).encode(x)
    assert enc.scale is None and enc.zero is None
    assert_close(get_codec(name).decode(enc), x, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("bits", [4, 2, 1])
@pytest.mark.parametrize("n", [1, 7, 16, 19])
def test_packing_round_trips_every_code(bits, n):
    codes = torch.arange(2**bits, dtype=torch.uint8).repeat(3, 40)[:, :n]
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, math.ceil(n * bits / 8)) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, n, bits), codes)


@pytest.mark.parametrize(
    ("bits", "codes", "packed"),
    [
        (4, [1, 2, 3], [0x21, 0x03]),  # element 2i in the low nibble
        (2, [1, 2, 3, 0, 3], [0b00_11_10_01, 0b11]),  # element 4i in bits 0-1
        (1, [1, 0, 1, 1, 0, 0, 0, 1, 1], [0b1000_1101, 0b1]),  # element 8i in bit 0
    ],
)
def test_packing_puts_the_first_element_in_the_lowest_bits(bits, codes, packed):
    assert pack_codes(torch.tensor(codes, dtype=torch.uint8), bits).tolist() == packed


def test_narrow_int_codecs_round_trip_exactly_on_their_own_grid():
    # Codes on the grid decode back to the same numbers: 0 .. 2^bits - 1 with min 0 and scale 1 are exact in fp16.
    for bits in (2, 1):
        x = torch.arange(2**bits, dtype=torch.float32).repeat(4, 2)  # [4, 2^(bits+1)], each row a group
        codec = IntCodec(bits)
        assert_close(codec.decode(codec.encode(x, -1, x.shape[-1])), x, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "payload_bits", "n_stats"),
    [("fp32", 32, 0), ("bf16", 16, 0), ("fp8", 8, 1), ("int8", 8, 2), ("int4", 4, 2), ("int2", 2, 2), ("int1", 1, 2)],
)
@pytest.mark.parametrize("dim", [TOKENS, CHANNELS])
def test_encoded_bytes_match_a_hand_count(name, payload_bits, n_stats, dim):
    shape, group_size = (2, 3, 37, 10), 8
    groups = {TOKENS: math.ceil(37 / 8) * 10, CHANNELS: 37 * math.ceil(10 / 8)}[dim]  # per (batch, head)
    row_bytes = math.ceil(10 * payload_bits / 8)  # a row of 10 packed codes ends in a whole byte
    expected = 2 * 3 * 37 * row_bytes + 2 * 3 * groups * n_stats * 2  # stats are fp16
    codec = get_codec(name)
    assert codec.encode(_randn(*shape), dim, group_size).nbytes == expected
    assert codec.stored_bytes(shape, dim, group_size) == expected


@pytest.mark.parametrize("name", ["fp8", "int8", "int4", "int2", "int1"])
def test_decoding_a_slice_into_a_buffer_matches_decoding_it_alone(name):
    codec = get_codec(name)
    for dim, group_size in ((TOKENS, 4), (CHANNELS, 4), (CHANNELS, 3)):  # the last: ragged channel groups
        enc = codec.encode(_randn(2, 3, 20, 10, seed=3), dim, group_size)
        part = enc.narrow(TOKENS, 8, 8)
        buffer = torch.full((2, 3, 12, 10), math.nan)
        codec.decode(part, out=buffer[:, :, 2:10])
        # Decoding is elementwise (cast, times scale, plus zero: each one correctly rounded op, no sums), so where
        # an element sits in the buffer or a vector register cannot change it: equal bit for bit.
        assert_close(buffer[:, :, 2:10], codec.decode(enc)[:, :, 8:16], rtol=0, atol=0)


def test_attention_error_falls_as_bits_rise():
    q, k, v = _randn(2, 2, 3, 32, seed=4), _randn(2, 2, 300, 32, seed=5), _randn(2, 2, 300, 32, seed=6)
    err = {name: codec_error(name, q, k, v, group_size=32) for name in CODECS}
    # Per-group int8 (about 8 bits in a small range) beats e4m3 (3 mantissa bits) on the same groups. fp32 stores
    # the input unchanged, so its attention is the same kernel on the same data as the reference: exactly 0.
    order = ["int1", "int2", "int4", "fp8", "int8", "bf16", "fp16", "fp32"]
    assert all(err[a] > err[b] for a, b in itertools.pairwise(order)) and err["fp32"] == 0.0, err


# -- the quantized cache -------------------------------------------------------------------------------------------
def _filled(caches: list, steps: list[int], seed: int = 0, n_layers: int = 2) -> None:
    """Feed the same random K/V to every cache, in steps of the given token counts."""
    gen = torch.Generator().manual_seed(seed)
    c0 = caches[0]
    for t in steps:
        kv = [torch.randn(c0.batch_size, t, c0.n_kv_heads, c0.head_dim, generator=gen) for _ in range(2 * n_layers)]
        for cache in caches:
            cache.reserve(t)
            for layer in range(n_layers):
                cache.append(layer, kv[2 * layer], kv[2 * layer + 1])


SHAPE = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)


def _cache(shape: CacheShape = SHAPE, **kw) -> QuantizedKVCache:
    args = dict(batch_size=2, capacity=96, group_size=8, residual=5)
    return QuantizedKVCache(shape, **(args | kw))


def _queries(t: int, seed: int) -> torch.Tensor:
    """Grouped, scaled queries for ``_cache``: ``[B=2, Hkv=2, G=2, T, D=16]`` times 1/sqrt(16)."""
    return _randn(2, 2, 2, t, 16, seed=seed) / 4


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "fp8"])
@pytest.mark.parametrize("key_quant", ["per-channel", "per-token"])
@pytest.mark.parametrize("chunk_size", [16, 24, 128], ids=["divides", "does-not-divide", "one-chunk"])
def test_chunked_equals_naive(codec, key_quant, chunk_size):
    kw = dict(codec=codec, key_quant=key_quant, chunk_size=chunk_size)
    chunked, naive = _cache(attention="chunked", **kw), _cache(attention="naive", **kw)
    _filled([chunked, naive], [41, 1, 1, 3, 1, 1, 1, 1, 1, 1])  # 51 tokens: 40 quantized, 11 in the residual
    q1, q3 = _queries(1, seed=7), _queries(3, seed=8)
    # The same dequantized values, but an online softmax over chunks vs one softmax: outputs (|x| < 1) to rounding.
    assert_close(chunked.attend(1, q1), naive.attend(1, q1), rtol=1e-5, atol=1e-6)
    for cache in (chunked, naive):  # a step of 3 new tokens: causal within the step
        cache.reserve(3)
        cache.append(0, *_randn(2, 3, 2, 32, seed=9).chunk(2, dim=-1))
    assert_close(chunked.attend(0, q3), naive.attend(0, q3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key_quant", ["per-channel", "per-token"])
def test_key_token_groups_and_channel_groups_are_two_settings(key_quant):
    """Keys grouped along 4 tokens and values along 16 channels (KIVI's G split in two): the chunked path still
    reads what the naive one decodes, and the key codes are grouped as asked."""
    kw = dict(codec="int4", key_quant=key_quant, key_group_tokens=4, group_size=16, chunk_size=12)
    chunked, naive = _cache(attention="chunked", **kw), _cache(attention="naive", **kw)
    _filled([chunked, naive], [41, 1, 1])  # 43 tokens: (43 - 5) // 4 * 4 = 36 quantized
    assert_close(chunked.attend(1, _queries(1, seed=3)), naive.attend(1, _queries(1, seed=3)), rtol=1e-5, atol=1e-6)
    keys, values = chunked._k[0], chunked._v[0]
    assert (keys.group_size, values.group_size) == ((4, 16) if key_quant == "per-channel" else (16, 16))


@pytest.mark.parametrize(("d", "group_size"), [(16, 8), (10, 4), (16, 32)], ids=["2-groups", "ragged", "1-group"])
@pytest.mark.parametrize("g", [1, 3])
def test_int8_key_scores_err_by_at_most_the_query_rounding(d, group_size, g):
    codec = get_codec("int8")
    keys = codec.encode(_randn(2, 2, 64, d, seed=10), CHANNELS, group_size)
    k_hat = codec.decode(keys)
    qs = _randn(2, 2, g, d, seed=11)
    # q is rounded to int8 with step sigma = max|q| / 127, so each score moves by at most sigma/2 * sum|k|.
    bound = qs.abs().amax(-1, keepdim=True) / 127 / 2 * k_hat.abs().sum(-1).unsqueeze(-2)
    scores = int8_key_scores(qs, keys.payload, keys.scale, codec.bias(keys), group_size)
    err = (scores - qs @ k_hat.transpose(-1, -2)).abs()
    assert torch.all(err <= bound * (1 + 1e-4) + 1e-5)
    assert err.max() > 0  # q really was rounded


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("group_size", [5, 16], ids=["ragged-channel-groups", "one-group"])
def test_folding_value_scales_into_p_equals_dequantizing_the_values(name, group_size):
    codec = get_codec(name)
    values = codec.encode(_randn(2, 3, 24, 10, seed=12), CHANNELS, group_size)
    p = torch.softmax(_randn(2, 3, 4, 24, seed=13), dim=-1)

    def codes(start: int, n: int) -> torch.Tensor:
        return codec.codes(values.narrow(2, start, n))

    scratch = torch.empty(2, 3, 16, 10)  # chunks of 16: 24 = 16 + 8
    folded = folded_value_product(p, codes, values.scale, codec.bias(values), group_size, scratch)
    # Scales applied before or after the sum over 24 tokens: each of the 24 products (|v| < 4) rounds differently,
    # so an output near 0 can be off by up to ~24 x 2^-24 x 4 = 6e-6 (1e-6 seen); a wrong scale moves it by a share
    # of the value itself.
    assert_close(folded, p @ codec.decode(values), rtol=1e-5, atol=6e-6)


def test_int_dot_is_close_to_chunked_and_about_as_accurate():
    kw = dict(codec="int8", key_quant="per-token", capacity=300, residual=16)
    int_dot, chunked = _cache(attention="int-dot", **kw), _cache(attention="chunked", **kw)
    exact = _cache(capacity=300, residual=300)
    _filled([int_dot, chunked, exact], [250, 1, 1])
    q = _queries(1, seed=11)
    ref = exact.attend(1, q)
    out_int, out_chunked = int_dot.attend(1, q), chunked.attend(1, q)
    assert_close(out_int, out_chunked, rtol=0, atol=2e-2)
    assert (out_int - ref).norm() < 2 * (out_chunked - ref).norm()


def _decoder_logits(model: Decoder, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Two prefills (the second a multi-token step over a non-empty cache), then one decode step per token."""
    steps = [model.prefill(tokens[:, :20], cache), model.prefill(tokens[:, 20:29], cache)]
    steps += [model.decode_step(tokens[:, t], cache)[:, None] for t in range(29, tokens.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.fixture(scope="module")
def reference():
    """A tiny model, 40 tokens, and its logits with the contiguous fp32 cache."""
    model = Decoder(tiny_config(), device="cpu")
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(12))
    return model, tokens, _decoder_logits(model, ContiguousKVCache.for_model(model, 2, 64), tokens)


@pytest.mark.parametrize(
    "kw",
    [
        dict(codec="fp32", residual=0),
        dict(codec="fp32", residual=0, attention="naive"),
        dict(codec="int4", residual=64),
        dict(codec="int4", residual=64, attention="naive"),
        dict(codec="int8", residual=64, key_quant="per-token", attention="int-dot"),
    ],
    ids=["fp32-chunked", "fp32-naive", "residual-covers-all", "residual-covers-all-naive", "int-dot-residual"],
)
def test_lossless_configurations_match_the_contiguous_cache(reference, kw):
    model, tokens, expected = reference
    got = _decoder_logits(model, QuantizedKVCache.for_model(model, 2, 64, group_size=8, chunk_size=16, **kw), tokens)
    # Equal up to fp32 rounding: online softmax divides by the sum once at the end, softmax before p @ v.
    assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_lossy_cache_does_change_the_logits(reference):
    """The control for the test above: int4 over most of the context moves the logits well past its tolerance."""
    model, tokens, expected = reference
    got = _decoder_logits(
        model, QuantizedKVCache.for_model(model, 2, 64, codec="int4", group_size=8, residual=0), tokens
    )
    assert (got - expected).abs().max() > 1e-4


def test_read_returns_residual_tokens_exactly_and_quantized_ones_within_half_a_scale():
    cache, exact = _cache(codec="int8"), _cache(residual=96)
    _filled([cache, exact], [30, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])  # 42 tokens: 32 quantized, and a wrapped ring
    (k, v), (k_ref, v_ref) = cache.read(1), exact.read(1)
    # The residual ring holds copies of the fp32 input: equal bit for bit.
    assert_close(k[:, :, 32:], k_ref[:, :, 32:], rtol=0, atol=0)
    assert_close(v[:, :, 32:], v_ref[:, :, 32:], rtol=0, atol=0)
    k_scale = _per_element(get_codec("int8").encode(k_ref[:, :, :32], TOKENS, 8).scale, TOKENS, 8, 32)
    assert torch.all((k[:, :, :32] - k_ref[:, :, :32]).abs() <= k_scale / 2 * (1 + 1e-3) + 1e-6)


@pytest.mark.parametrize(
    ("codec", "payload_bytes", "n_stats"),
    [("int8", 1, 2), ("int4", 0.5, 2), ("int2", 0.25, 2), ("fp8", 1, 1), ("fp16", 2, 0)],
)
@pytest.mark.parametrize("attention", ["chunked", "naive"])
@pytest.mark.parametrize("channels", [None, 5], ids=["one-G", "channels-5"])
def test_bytes_match_a_hand_count(codec, payload_bytes, n_stats, attention, channels):
    """``key_group_tokens`` G groups keys along tokens; ``group_size`` (default: G) groups values along channels."""
    L, B, H, D, G, R = 2, 2, 3, 10, 4, 7  # noqa: N806 - the course's symbols. D=10: value groups of 4, 4, 2
    C = G if channels is None else channels  # noqa: N806 - channels per value scale
    groups = dict(group_size=G) if channels is None else dict(key_group_tokens=G, group_size=C)  # KIVI's one G, or two
    cache = QuantizedKVCache(CacheShape(L, H, D), B, 100, codec=codec, residual=R, attention=attention, **groups)
    _filled([cache], [41, *[1] * 9], n_layers=L)  # 50 tokens: (50 - 7) // 4 * 4 = 40 quantized, 10 residual

    def quantized(n: int) -> float:  # n tokens, K and V, all layers and sequences
        payload = 2 * L * B * H * n * math.ceil(D * payload_bytes)  # a packed row ends in a whole byte
        key_stats = L * B * H * (n // G) * D * n_stats * 2  # per channel, one per group of G tokens; fp16
        value_stats = L * B * H * n * math.ceil(D / C) * n_stats * 2  # per token, one per group of C channels
        return payload + key_stats + value_stats

    residual_token = 2 * L * B * H * D * 4  # one token's K and V at fp32
    assert cache.bytes_stored() == quantized(40) + 10 * residual_token
    copy = 2 * L * B * H * 50 * D * 4  # the naive path's fp32 copy of every token: written, then read again
    expected_read = quantized(40) + 10 * residual_token + (2 * copy if attention == "naive" else 0)
    assert cache.bytes_read_per_step() == expected_read
    copy_1000 = 2 * L * B * H * 1000 * D * 4 if attention == "naive" else 0
    assert cache.bytes_read_per_step(context=1000) == quantized(992) + 8 * residual_token + 2 * copy_1000
    # The next step (token 51) completes the group 40..43 and keeps its own token in the residual.
    assert cache.bytes_written_per_step() == quantized(44) - quantized(40) + residual_token
    _filled([cache], [1], n_layers=L)
    assert cache.bytes_written_per_step() == residual_token  # token 52: no group completes
    assert cache.bytes_per_token == pytest.approx(quantized(G) / G / B)


def test_a_residual_covering_the_capacity_stores_everything_at_full_precision():
    cache = _cache(residual=96, codec="int4")
    _filled([cache], [50])
    assert cache.bytes_stored() == 2 * 2 * 2 * 2 * 50 * 16 * 4  # K and V, 2 layers, 2 sequences, 2 heads, fp32
    assert cache.bytes_stored() == ContiguousKVCache(SHAPE, 2, 96).bytes_read_per_step(50)


def test_the_residual_keeps_k_and_v_in_the_dtype_they_arrive_in():
    cache = _cache(shape=CacheShape(2, 2, 16, dtype="bf16"), residual=96, codec="int4")
    assert cache.torch_dtype == torch.bfloat16
    _filled([cache], [50])  # fp32 input, stored as bf16, as a bf16 model would hand it over
    assert cache.read(0)[0].dtype == torch.float32  # read dequantizes to fp32, the residual included
    assert cache.bytes_stored() == 2 * 2 * 2 * 2 * 50 * 16 * 2  # K and V, 2 layers, 2 sequences, 2 heads, bf16


def test_a_sliding_window_is_refused():
    cache = _cache()
    _filled([cache], [3])
    with pytest.raises(ValueError, match="^layer_window: 2 .*QuantizedKVCache"):
        cache.attend(0, _queries(1, seed=0), layer_window=2)


# -- arguments -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(codec="int3"), r"codec: .*'int3'.*allowed: fp32, fp16, bf16, fp8, fp8-tensor, int8, int4, int2, int1"),
        (dict(group_size=0), r"group_size: 0 .*allowed: an integer >= 1"),
        (dict(group_size=2.5), r"group_size: 2.5 .*allowed: an integer >= 1"),
        (dict(residual=-1), r"residual: -1 .*allowed: an integer >= 0"),
        (dict(chunk_size=12), r"chunk_size: 12 .*allowed: a positive multiple of key_group_tokens=8"),
        (dict(attention="fast"), r"attention: .*'fast'.*allowed: chunked, naive, int-dot"),
        (dict(key_quant="per-head"), r"key_quant: .*'per-head'.*allowed: per-channel, per-token"),
        (dict(attention="int-dot"), r"attention: 'int-dot' needs codec='int8' and key_quant='per-token'"),
        (dict(attention="int-dot", codec="int4", key_quant="per-token"), r"attention: 'int-dot' needs codec='int8'"),
        (dict(capacity=0), r"capacity: 0 .*allowed: an integer >= 1"),
        (dict(capacity=None), r"capacity: None .*allowed: an integer >= 1"),
        (dict(shape=CacheShape(2, 1, 40, latent_values=32)), r"shape: an MLA latent .*allowed: per-head K/V"),
    ],
)
def test_bad_cache_arguments_name_the_argument_and_the_allowed_values(kw, match):
    with pytest.raises(ValueError, match=match):
        _cache(**kw)


def test_bad_codec_arguments_name_the_argument_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"codec: .*'int3'.*allowed: fp32, fp16, bf16, fp8, fp8-tensor, int8, int4"):
        get_codec("int3")
    with pytest.raises(ValueError, match=r"bits: 3; allowed: 8, 4, 2, 1"):
        IntCodec(3)
    with pytest.raises(ValueError, match=r"group_size: -4 .*allowed: an integer >= 1"):
        get_codec("int8").encode(_randn(4, 8), group_size=-4)
    with pytest.raises(ValueError, match=r"group_dim: 2 .*allowed: a dimension in \[-2, 1\]"):
        get_codec("int8").encode(_randn(4, 8), group_dim=2)
    with pytest.raises(ValueError, match=r"key_quant: .*'per-row'.*allowed: per-channel, per-token"):
        codec_error("int8", _randn(1, 1, 1, 8), _randn(1, 1, 4, 8), _randn(1, 1, 4, 8), key_quant="per-row")


def test_aliases_from_kvlab_dtypes_name_the_same_codecs():
    assert get_codec("float8_e4m3fn").name == "fp8" and get_codec("bfloat16").name == "bf16"


def test_fp8_tensor_stores_one_byte_per_number_and_costs_an_uncalibrated_scale():
    """vLLM's default FP8 cache: no per-group scale stored, so 1 B per number; with its scale left at 1.0, values in
    e4m3's range round to 3 mantissa bits, values past 448 clip, and tiny ones fall to its subnormal step."""
    per_tensor, per_group = get_codec("fp8-tensor"), get_codec("fp8")
    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(0))
    enc = per_tensor.encode(x, -1, 32)
    assert enc.nbytes == x.numel() and enc.scale is None
    assert per_tensor.stored_bytes(tuple(x.shape), -1, 32) == x.numel() < per_group.stored_bytes(tuple(x.shape), -1, 32)
    torch.testing.assert_close(per_tensor.decode(enc), x, rtol=2**-4, atol=2**-9)
    for scaled in (x * 1000, x * 1e-4):  # outside what a scale of 1.0 represents well; a per-group scale adapts
        err_tensor = (per_tensor.decode(per_tensor.encode(scaled)) - scaled).abs().mean()
        err_group = (per_group.decode(per_group.encode(scaled, -1, 32)) - scaled).abs().mean()
        assert err_tensor > 10 * err_group
