"""Lesson 09's checkers (KV quantization): a right answer passes silently, a likely wrong one fails with a message that
names the fix, hidden checks withhold the expected value, and the measured check is tested on fabricated sweeps
(the remeasure replaced), so nothing here is timed."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autograde import hidden
from kvlab import checks, roofline
from kvlab.course import lesson09_kv_quantization as lesson09
from kvlab.kernels.reference import decode_attention
from kvlab.machine.timing import Bandwidth
from kvlab.measure.sweep import Sweep
from kvlab.metrics import RequestTiming
from tests import helpers
from tests.helpers import Remeasure, assert_fails, assert_silent

BW = helpers.BW


# -- reference answers, written the way a learner would -------------------------------------------------------------
def quantize(x, bits, group_size, dim):
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the length {n} along dim {dim}")
    xg = x.float().unflatten(dim, (n // group_size, group_size))
    lo, hi = xg.amin(dim + 1, keepdim=True), xg.amax(dim + 1, keepdim=True)
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-12)
    codes = ((xg - lo) / scale).round().clamp(0, qmax)
    return codes.flatten(dim, dim + 1).to(torch.uint8), scale.squeeze(dim + 1), lo.squeeze(dim + 1)


def dequantize(codes, scale, zero, group_size, dim):
    dim = dim % codes.dim()
    cg = codes.float().unflatten(dim, (-1, group_size))
    return (cg * scale.unsqueeze(dim + 1) + zero.unsqueeze(dim + 1)).flatten(dim, dim + 1)


STATS = {"fp8": 1, "int8": 2, "int4": 2}


def quantized_bytes(shape, codec, group_size, group_dim):
    d = group_dim % len(shape)
    rows = math.prod(shape[:-1])
    per_row = math.ceil(shape[-1] / 2) if codec == "int4" else shape[-1]
    groups = math.prod(shape[:d]) * math.prod(shape[d + 1 :]) * math.ceil(shape[d] / group_size)
    return rows * per_row + STATS[codec] * 2 * groups


def kivi_bytes(cfg, context, codec, group_size, residual, batch, attention):
    n_quant = max(context - residual, 0) // group_size * group_size
    shape = (batch, cfg.n_kv_heads, n_quant, cfg.head_dim)
    quant = quantized_bytes(shape, codec, group_size, 2) + quantized_bytes(shape, codec, group_size, 3)
    exact = 2 * batch * cfg.n_kv_heads * (context - n_quant) * cfg.head_dim * roofline.kv_element_bytes(cfg.dtype)
    stored = round(cfg.n_layers * (quant + exact))
    copy = 2 * cfg.n_layers * batch * cfg.n_kv_heads * context * cfg.head_dim * 4
    return stored, stored if attention == "chunked" else stored + 2 * copy


def fp8_kv_tpot(cfg, context, bandwidth_gbps):
    weights = roofline.weight_bytes_read(cfg)
    return tuple(
        roofline.predict_tpot_ms(weights + roofline.kv_bytes_per_step(cfg, context, kv_dtype=kv), bandwidth_gbps)
        for kv in ("bf16", "fp8")
    )


def kivi_error(q, k, v, bits, group_size, key_quant, value_dim=3, scale=True):
    key_dim = 2 if key_quant == "per-channel" else 3
    k_hat = dequantize(*quantize(k, bits, group_size, key_dim), group_size, key_dim)
    v_hat = dequantize(*quantize(v, bits, group_size, value_dim), group_size, value_dim)
    qs = q / math.sqrt(q.shape[-1]) if scale else q
    exact = decode_attention(qs, k.transpose(-1, -2), v)
    approx = decode_attention(qs, k_hat.transpose(-1, -2), v_hat)
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact))


def fake_sweep(slope_us: float, kv_per_token: float, bandwidth: Bandwidth = BW, intercept_ms: float = 3.0) -> Sweep:
    return helpers.fake_sweep(slope_us, kv_per_token, bandwidth, intercept_ms)


# µs per token; bytes per token as cpu-tiny's caches store them. At 10 GB/s fp32's bytes alone take 0.82 µs.
PLAUSIBLE = {"fp32": (1.0, 8192.0), "fp8": (12.0, 2176.0), "int8": (3.0, 2304.0), "int4": (5.0, 1280.0)}


def codec_sweeps(slopes: dict[str, tuple[float, float]] = PLAUSIBLE, bandwidth: Bandwidth = BW) -> dict[str, Sweep]:
    return {name: fake_sweep(slope, size, bandwidth) for name, (slope, size) in slopes.items()}


def ratios_of(sweeps: dict[str, Sweep]) -> dict[str, float]:
    return {name: s.fit.slope / sweeps["fp32"].fit.slope for name, s in sweeps.items()}


@pytest.fixture(autouse=True)
def _one_thread():
    # the checks' tensors are small: more threads only add contention on a shared machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- right answers pass silently, public and hidden ------------------------------------------------------------------
FUNCTIONS = [
    (checks.check_quantized_bytes, hidden.check_quantized_bytes, quantized_bytes),
    (checks.check_kivi_bytes, hidden.check_kivi_bytes, kivi_bytes),
    (checks.check_fp8_kv_tpot, hidden.check_fp8_kv_tpot, fp8_kv_tpot),
    (checks.check_kivi_error, hidden.check_kivi_error, kivi_error),
]


@pytest.mark.parametrize(("check", "hidden_check", "answer"), FUNCTIONS, ids=[c.__name__ for c, _, _ in FUNCTIONS])
def test_right_answer_passes_silently(capsys, check, hidden_check, answer):
    assert_silent(capsys, check, answer)
    assert_silent(capsys, hidden_check, answer)


def test_quantizer_passes_silently(capsys):
    for check in (checks.check_quantize, hidden.check_quantize):
        assert_silent(capsys, check, quantize)
    for check in (checks.check_dequantize, hidden.check_dequantize):
        assert_silent(capsys, check, dequantize)


def test_measured_right_answer_passes_silently(capsys):
    sweeps = codec_sweeps()
    assert_silent(capsys, checks.check_codec_slopes, ratios_of(sweeps), sweeps)


# -- exercise 1 ------------------------------------------------------------------------------------------------------
def test_quantizer_slips_are_named():
    def symmetric(x, bits, group_size, dim):
        codes, scale, zero = quantize(x, bits, group_size, dim)
        return codes, scale, torch.zeros_like(zero)

    assert_fails(checks.check_quantize, symmetric, match="symmetric quantization")

    def two_to_the_bits(x, bits, group_size, dim):
        dim = dim % x.dim()
        xg = x.unflatten(dim, (-1, group_size))
        lo, hi = xg.amin(dim + 1, keepdim=True), xg.amax(dim + 1, keepdim=True)
        scale = ((hi - lo) / 2**bits).clamp_min(1e-12)
        codes = ((xg - lo) / scale).round().clamp(0, 2**bits - 1)
        return codes.flatten(dim, dim + 1), scale.squeeze(dim + 1), lo.squeeze(dim + 1)

    assert_fails(checks.check_quantize, two_to_the_bits, match=r"divide by that")

    def floor(x, bits, group_size, dim):
        codes, scale, zero = quantize(x, bits, group_size, dim)
        d = dim % x.dim()
        raw = (x - zero.repeat_interleave(group_size, d)) / scale.repeat_interleave(group_size, d)
        return raw.floor().clamp(0, 2**bits - 1), scale, zero

    assert_fails(checks.check_quantize, floor, match="not floor")


def test_quantizer_grouping_and_shapes():
    def always_last(x, bits, group_size, dim):
        return quantize(x, bits, group_size, -1)

    assert_fails(checks.check_quantize, always_last, match="shape")

    def no_floor(x, bits, group_size, dim):
        dim = dim % x.dim()
        xg = x.unflatten(dim, (-1, group_size))
        lo, hi = xg.amin(dim + 1, keepdim=True), xg.amax(dim + 1, keepdim=True)
        scale = (hi - lo) / (2**bits - 1)
        codes = ((xg - lo) / scale).round()
        return codes.flatten(dim, dim + 1), scale.squeeze(dim + 1), lo.squeeze(dim + 1)

    assert_fails(checks.check_quantize, no_floor, match="floor the scale")

    def wrong_spread(codes, scale, zero, group_size, dim):
        d = dim % codes.dim()
        return codes.float() * scale.repeat(*[group_size if i == d else 1 for i in range(codes.dim())]) + zero.repeat(
            *[group_size if i == d else 1 for i in range(codes.dim())]
        )

    assert_fails(checks.check_dequantize, wrong_spread, match="tiles the statistics")

    def no_zero(codes, scale, zero, group_size, dim):
        return dequantize(codes, scale, torch.zeros_like(zero), group_size, dim)

    assert_fails(checks.check_dequantize, no_zero, match="leaves out the zero point")
    assert_fails(checks.check_dequantize, lambda *a: a[0], match="up to")
    assert_fails(checks.check_quantize, lambda *a: None, match=r"tuple \(codes, scale, zero\)")


def test_quantizer_must_refuse_a_ragged_group():
    def ragged_ok(x, bits, group_size, dim):
        if x.shape[dim % x.dim()] % group_size:
            return None
        return quantize(x, bits, group_size, dim)

    assert_fails(checks.check_quantize, ragged_ok, match="raise ValueError naming group_size")

    def wrong_error(x, bits, group_size, dim):
        if x.shape[dim % x.dim()] % group_size:
            raise RuntimeError("no")
        return quantize(x, bits, group_size, dim)

    assert_fails(checks.check_quantize, wrong_error, match="RuntimeError")


def test_quantizer_not_implemented_is_named():
    def todo(*args):
        raise NotImplementedError

    assert_fails(checks.check_quantize, todo, match="not implemented yet")
    assert_fails(checks.check_dequantize, todo, match="not implemented yet")


# -- exercise 2 ------------------------------------------------------------------------------------------------------
def test_quantized_bytes_slips_are_named():
    def no_zero(shape, codec, g, d):
        return quantized_bytes(shape, "fp8" if codec != "int4" else codec, g, d) if codec == "int8" else None

    assert_fails(checks.check_quantized_bytes, no_zero, match="wrong statistics")

    def unpacked(shape, codec, g, d):
        return quantized_bytes(shape, "int8" if codec == "int4" else codec, g, d)

    assert_fails(checks.check_quantized_bytes, unpacked, match="two per byte")

    def floored(shape, codec, g, d):
        dd = d % len(shape)
        rows = math.prod(shape[:-1])
        per_row = math.ceil(shape[-1] / 2) if codec == "int4" else shape[-1]
        return rows * per_row + STATS[codec] * 2 * (math.prod(shape) // shape[dd]) * (shape[dd] // g)

    assert_fails(checks.check_quantized_bytes, floored, match="ragged last group")

    def across_rows(shape, codec, g, d):
        right = quantized_bytes(shape, codec, g, d)
        if codec == "int4":
            return right - math.prod(shape[:-1]) * math.ceil(shape[-1] / 2) + math.ceil(math.prod(shape) / 2)
        return right

    assert_fails(checks.check_quantized_bytes, across_rows, match="packs across rows")
    assert_fails(checks.check_quantized_bytes, lambda *a: 8 * quantized_bytes(*a), match="in bits")
    assert_fails(checks.check_quantized_bytes, lambda *a: float(quantized_bytes(*a)), match="an int number")


# -- exercise 3 ------------------------------------------------------------------------------------------------------
def test_kivi_bytes_slips_are_named():
    def no_residual(cfg, context, codec, g, r, batch, attention):
        return kivi_bytes(cfg, context, codec, g, 0, batch, attention)

    assert_fails(checks.check_kivi_bytes, no_residual, match="no recent tokens exact")

    def naive_without_copy(cfg, context, codec, g, r, batch, attention):
        stored, _ = kivi_bytes(cfg, context, codec, g, r, batch, "chunked")
        return stored, stored

    assert_fails(checks.check_kivi_bytes, naive_without_copy, match="writes an fp32 copy")

    def copy_once(cfg, context, codec, g, r, batch, attention):
        stored, read = kivi_bytes(cfg, context, codec, g, r, batch, attention)
        return stored, (stored + read) // 2 if attention == "naive" else read

    assert_fails(checks.check_kivi_bytes, copy_once, match="twice")

    def residual_fp32(cfg, context, codec, g, r, batch, attention):
        return kivi_bytes(cfg.replace(dtype="fp32"), context, codec, g, r, batch, attention)

    assert_fails(checks.check_kivi_bytes, residual_fp32, match="residual tokens at fp32")

    def partial_group(cfg, context, codec, g, r, batch, attention):
        return (
            kivi_bytes(cfg, context, codec, 1, r, batch, attention)
            if codec == "int4"
            else kivi_bytes(cfg, context, codec, g, r, batch, attention)
        )

    assert_fails(checks.check_kivi_bytes, partial_group, match=r"bytes_stored: got")
    assert_fails(checks.check_kivi_bytes, lambda *a: 3, match=r"a pair \(bytes_stored, bytes_read\)")


# -- exercise 4 ------------------------------------------------------------------------------------------------------
def test_codec_slopes_consistency_slips():
    sweeps = codec_sweeps()
    right = ratios_of(sweeps)
    assert_fails(checks.check_codec_slopes, {k: 1 / r for k, r in right.items()}, sweeps, match="inverted")
    byte_ratios = {k: s.kv_bytes_per_token / 8192 for k, s in sweeps.items()}
    assert_fails(checks.check_codec_slopes, byte_ratios, sweeps, match="byte ratio, the prediction")
    assert_fails(checks.check_codec_slopes, {"fp32": 1.0}, sweeps, match="One ratio per cache")


def test_codec_slopes_need_one_bandwidth_measurement():
    sweeps = codec_sweeps()
    sweeps["int4"] = fake_sweep(5.0, 1280.0, Bandwidth("cpu", 64.0, 10.0, 10.0, 11.0, 11.0, threads=1))
    assert_fails(checks.check_codec_slopes, ratios_of(sweeps), sweeps, match="one Bandwidth object")


def test_codec_band_allows_a_steeper_codec_and_a_flat_fp32(capsys):
    # The honest CPU result: quantized slopes far above fp32's, and fp32's own line as flat as its bytes allow.
    sweeps = codec_sweeps({"fp32": (0.5, 8192.0), "fp8": (40.0, 2176.0), "int8": (9.0, 2304.0)})
    assert_silent(capsys, checks.check_codec_slopes, ratios_of(sweeps), sweeps)


def test_a_codec_faster_than_its_bytes_is_not_read_and_never_fails_the_arithmetic(capsys):
    fast = codec_sweeps({**PLAUSIBLE, "int8": (0.05, 2304.0)})  # int8 at 0.05 µs, its bytes alone take 0.23
    seen = lesson09.codec_reading(fast)
    assert not seen.seen and len(seen.unmet) == 1 and seen.unmet[0].startswith("int8's slope")
    checks.check_codec_slopes(ratios_of(fast), fast)
    out = capsys.readouterr().out
    assert "did not show" in out and "int8's slope" in out and "does not depend" in out
    assert lesson09.codec_contradiction(fast) == ""  # unreadable: no verdict either way


def test_the_timing_cell_measures_again_while_unreadable():
    fast = codec_sweeps({**PLAUSIBLE, "int8": (0.05, 2304.0)})
    takes = iter([fast, codec_sweeps()])
    sweeps, seen = checks.retake(lambda: next(takes), checks.codec_reading)
    assert seen.seen and seen.takes == 2 and sweeps["int8"].fit.slope > fast["int8"].fit.slope
    always = Remeasure(fast)
    sweeps, seen = checks.retake(always, checks.codec_reading)
    assert not seen.seen and always.calls == checks.TAKES and "NOT READABLE" in str(seen)


def test_codec_slopes_say_when_the_effect_was_not_seen(capsys):
    # fp32's line unreadable (its points scattered): passed on the arithmetic, and told so.
    noisy = codec_sweeps()
    scattered = [
        dataclasses.replace(p, requests=[RequestTiming((t / 1e3, 2 * t / 1e3))])
        for p, t in zip(noisy["fp32"].points, (3.9, 3.0, 4.2, 3.3), strict=True)
    ]  # ms: up and down around a slope that is small next to the load's jitter
    noisy["fp32"] = dataclasses.replace(noisy["fp32"], points=scattered)
    assert noisy["fp32"].fit.r2 < lesson09.CODEC_MIN_R2
    checks.check_codec_slopes(ratios_of(noisy), noisy)
    out = capsys.readouterr().out
    assert "did not show" in out and "scattered" in out and "does not depend" in out


def test_codec_slopes_say_when_fp32_is_flatter_than_its_bytes(capsys):
    # The playtest's run: fp32 at 0.2 x the slope its bytes take (faster than the bandwidth), R² just readable.
    # The ratios over it are load, not codecs: passed on the arithmetic, and told so.
    impossible = codec_sweeps({**PLAUSIBLE, "fp32": (0.15, 8192.0)})
    checks.check_codec_slopes(ratios_of(impossible), impossible)
    out = capsys.readouterr().out
    assert "did not show" in out and "fp32's slope" in out and "bytes take" in out


def test_codec_slopes_say_when_a_run_contradicts_the_lesson(capsys):
    # Readable, inside the band, but int8 flatter than fp32: the opposite of what section 3 describes.
    flatter = codec_sweeps({**PLAUSIBLE, "int8": (0.5, 2304.0)})
    assert checks.codec_reading(flatter).seen
    checks.check_codec_slopes(ratios_of(flatter), flatter)
    out = capsys.readouterr().out
    assert "int8 came out flatter than fp32" in out and "does not depend" in out and "did not show" not in out
    assert out.strip() == checks.codec_contradiction(flatter)  # the check says what the timing cell said


# -- exercise 5 ------------------------------------------------------------------------------------------------------
def test_fp8_kv_tpot_slips_are_named():
    def kv_only(cfg, context, gbps):
        return tuple(
            roofline.predict_tpot_ms(roofline.kv_bytes_per_step(cfg, context, kv_dtype=kv), gbps)
            for kv in ("bf16", "fp8")
        )

    assert_fails(checks.check_fp8_kv_tpot, kv_only, match="KV bytes only")

    def grouped(cfg, context, gbps):
        weights = roofline.weight_bytes_read(cfg)
        fp8 = roofline.kv_bytes_per_step(cfg, context, kv_dtype="fp8", group_size=32)
        return fp8_kv_tpot(cfg, context, gbps)[0], roofline.predict_tpot_ms(weights + fp8, gbps)

    assert_fails(checks.check_fp8_kv_tpot, grouped, match="per-tensor scales")

    def seconds(cfg, context, gbps):
        return tuple(t / 1e3 for t in fp8_kv_tpot(cfg, context, gbps))

    assert_fails(checks.check_fp8_kv_tpot, seconds, match="in seconds")


# -- exercise 6 ------------------------------------------------------------------------------------------------------
def test_kivi_error_slips_are_named():
    def swapped(q, k, v, bits, g, key_quant):
        other = "per-token" if key_quant == "per-channel" else "per-channel"
        return kivi_error(q, k, v, bits, g, other)

    assert_fails(checks.check_kivi_error, swapped, match="groups the keys the other way")
    assert_fails(checks.check_kivi_error, lambda *a: kivi_error(*a, value_dim=2), match="values along the tokens")
    assert_fails(checks.check_kivi_error, lambda *a: kivi_error(*a, scale=False), match="1/sqrt")
    assert_fails(checks.check_kivi_error, lambda *a: "0.1", match="a number")


def test_per_channel_keys_win_on_outlier_channels():
    # The reason for KIVI's key grouping, on the checks' own data: two key channels 12x the others.
    q, k, v, bits, g, _ = lesson09.error_case(10, (1, 2, 2, 256, 64), 4, 32, "per-channel")
    assert kivi_error(q, k, v, bits, g, "per-channel") < 0.7 * kivi_error(q, k, v, bits, g, "per-token")


# -- hidden checks ---------------------------------------------------------------------------------------------------
def test_hidden_checks_withhold_the_expected_value():
    def off_by_one(*args):
        return quantized_bytes(*args) + 1

    message = assert_fails(hidden.check_quantized_bytes, off_by_one, match="does not reveal")
    assert str(quantized_bytes(*hidden.CASES["check_quantized_bytes"][0])) not in message

    def residual_zero(cfg, context, codec, g, r, batch, attention):
        return kivi_bytes(cfg, context, codec, g, 0, batch, attention)

    message = assert_fails(hidden.check_kivi_bytes, lambda *a: residual_zero(*a)[::-1], match="does not reveal")
    assert "It " not in message.split("does not reveal")[1]
    message = assert_fails(hidden.check_fp8_kv_tpot, lambda *a: (1.0, 1.0), match="does not reveal")
    assert repr(fp8_kv_tpot(*hidden.CASES["check_fp8_kv_tpot"][0])[0]) not in message
    message = assert_fails(hidden.check_kivi_error, lambda *a: kivi_error(*a, scale=False), match="does not reveal")
    assert "leaves out" not in message


def test_vllm_table_is_faster_with_fp8_at_every_context():
    # The published rows the lesson compares with: FP8's tokens per second at least BF16's, the gain growing.
    gains = [fp8 / bf16 for bf16, fp8 in lesson09.VLLM_L4_QWEN3_4B.values()]
    assert all(g >= 1 for g in gains) and gains == sorted(gains)
