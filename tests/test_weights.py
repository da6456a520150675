"""kvlab.model.weights: int8 weights through PyTorch's quantized kernel, half-precision weights, and the Decoder's
weight_dtype."""

import pytest
import torch
from torch.testing import assert_close

import kvlab.model.weights
from autograde import hidden
from kvlab import Decoder
from kvlab.checks import check_int8_weight_bytes
from kvlab.measure.step_time import layer_weights
from kvlab.model.weights import (
    WeightFormat,
    int8_step_weight_bytes,
    int8_weight_bytes,
    projection_shapes,
    quantize_int8,
)
from kvlab.roofline import weight_bytes_read

from .helpers import tiny_config


def test_int8_quantization_is_per_output_channel_and_within_half_a_step():
    w = torch.randn(32, 6) * torch.tensor([1e-3, 1.0, 5.0, 0.1, 2.0, 0.0])  # columns = output channels
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (6, 32) and scale.shape == (6,)
    assert q[:5].abs().amax(dim=1).tolist() == [127] * 5  # each channel's largest weight uses the full range
    err = (q.float() * scale[:, None] - w.T).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert int8_weight_bytes((32, 6)) == 32 * 6 + 4 * 6


def test_int8_product_within_activation_quantization_error_and_repacks_on_edit():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 1, 64, generator=gen), torch.randn(64, 40, generator=gen) * 0.05
    fmt = WeightFormat("int8")
    q, scale = quantize_int8(w)
    dequantized = (q.float() * scale[:, None]).T
    with torch.inference_mode():
        out = fmt.matmul(x, w)
        # The activation row is quantized to 7 bits (reduce_range: AVX2's int16 products would saturate on 8):
        # each element moves by at most half a step of (max - min) / 127, so a column moves by at most that
        # times the column's absolute sum.
        bound = float((x.amax() - x.amin()) / 127 / 2 * dequantized.abs().sum(dim=0).max())
        assert_close(out, x @ dequantized, rtol=0, atol=bound)
        with torch.no_grad():
            w.neg_()
        assert_close(fmt.matmul(x, w), -out, rtol=0, atol=2 * bound)


def test_decoder_int8_reads_a_quarter_of_the_bytes_and_stays_close_to_fp32():
    cfg = tiny_config(d_model=128, d_ff=256, vocab_size=512)
    fp32, int8 = Decoder(cfg, device="cpu", seed=0), Decoder(cfg, device="cpu", seed=7, weight_dtype="int8")
    assert fp32.weight_dtype == "fp32" and fp32.cfg.weight_dtypes is None
    int8.load_state_dict(fp32.state_dict())  # the packed copies follow the loaded weights
    assert int8.weight_dtype == "int8" and dict(int8.cfg.weight_dtypes) == {"embeddings": "int8", "other": "int8"}
    assert weight_bytes_read(int8.cfg) * 4 == pytest.approx(weight_bytes_read(fp32.cfg), rel=0.01)
    tokens = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    logits = {}
    for name, model in (("fp32", fp32), ("int8", int8)):
        cache = model.new_cache(1, 16)
        model.prefill(tokens, cache)
        logits[name] = model.decode_step(tokens[:, -1], cache)
    spread = float(logits["fp32"].std())
    assert_close(logits["int8"], logits["fp32"], rtol=0, atol=0.1 * spread)
    assert not torch.equal(logits["int8"], logits["fp32"])  # the int8 kernel really ran


def test_weight_dtype_errors_and_half_precision_warning(monkeypatch):
    with pytest.raises(ValueError, match="weight_dtype.*allowed: fp32, bf16, fp16, int8"):
        Decoder(tiny_config(), device="cpu", weight_dtype="int4")
    monkeypatch.setattr(kvlab.model.weights, "native_half", lambda dtype: False)
    with pytest.warns(RuntimeWarning, match="no native bf16 dot product"):
        Decoder(tiny_config(), device="cpu", weight_dtype="bf16")
    monkeypatch.setattr(kvlab.model.weights, "native_half", lambda dtype: True)
    with torch.inference_mode():
        model = Decoder(tiny_config(), device="cpu", weight_dtype="fp16")
        cache = model.new_cache(1, 4)
        assert model.decode_step(torch.tensor([3]), cache).dtype == torch.float32


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1, "head_dim": 24, "tie_embeddings": True}])
def test_projection_shapes_are_the_matrices_the_model_multiplies_by(overrides):
    model = Decoder(tiny_config(**overrides), device="cpu")
    matrices = [w for layer in layer_weights(model) for w in layer]
    assert projection_shapes(model.cfg) == [tuple(w.shape) for w in matrices]
    assert int8_step_weight_bytes(model.cfg) == sum(int8_weight_bytes(tuple(w.shape)) for w in matrices)


def test_int8_weight_bytes_checker_passes_the_reference_and_fails_the_slips():
    check_int8_weight_bytes(int8_step_weight_bytes)
    hidden.check_int8_weight_bytes(int8_step_weight_bytes)
    no_scales = lambda cfg: sum(i * o for i, o in projection_shapes(cfg))  # noqa: E731
    scale_per_input = lambda cfg: sum(i * o + 4 * i for i, o in projection_shapes(cfg))  # noqa: E731
    no_head = lambda cfg: int8_step_weight_bytes(cfg) - int8_weight_bytes((cfg.d_model, cfg.vocab_size))  # noqa: E731
    for slip in (no_scales, scale_per_input, no_head):
        with pytest.raises(AssertionError, match="int8_weight_bytes"):
            check_int8_weight_bytes(slip)
        with pytest.raises(AssertionError, match="int8_weight_bytes"):
            hidden.check_int8_weight_bytes(slip)


@pytest.fixture
def threads():
    """Set torch's thread count for one test and restore it afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("blocks", [2, 3, 4])
def test_column_blocks_product_is_the_plain_product(blocks):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 12 * 64, generator=gen)
    tied = torch.randn(12 * 64, 96, generator=gen).T  # a tied LM head: the embedding's transpose, not contiguous
    for x in (torch.randn(1, 96, generator=gen), torch.randn(2, 3, 96, generator=gen)):
        for weight in (w, tied):
            out = kvlab.model.weights.column_blocks_matmul(x, weight, blocks)
            assert out.shape == (*x.shape[:-1], weight.shape[1])
            assert_close(out, x @ weight, rtol=1e-5, atol=1e-5)


def test_columns_split_only_where_it_pays(monkeypatch):
    splits = kvlab.model.weights.splits_columns
    monkeypatch.setattr(kvlab.model.weights, "SPLIT_MIN_WEIGHTS", 64 * 64)
    rows, big = torch.randn(4, 64), torch.randn(64, 64)
    assert splits(rows, big, 2) and splits(torch.randn(2, 2, 64), big, 4) and splits(torch.randn(64, 64), big, 2)
    assert not splits(rows, torch.randn(64, 63), 2)  # columns not divisible by the threads
    assert not splits(rows, torch.randn(32, 64), 2)  # below the size where the second thread pays
    assert splits(torch.randn(2, 64), big, 2) and not splits(torch.randn(1, 1, 64), big, 2)  # one row: MKL's gemv
    assert not splits(torch.randn(65, 64), big, 2)  # a prefill: MKL threads it itself
    assert not splits(rows.bfloat16(), big.bfloat16(), 2)  # half precision was not measured
    assert not splits(torch.randn(4, 32), big, 2) and not splits(rows, big[0], 2)  # malformed: x @ w's own error


def test_batched_step_at_two_threads_runs_the_column_blocks_and_matches_one_thread(monkeypatch, threads):
    cfg = tiny_config(d_model=128, d_ff=256, vocab_size=512)
    model = Decoder(cfg, device="cpu", seed=0)
    tokens = torch.randint(0, 512, (4, 9), generator=torch.Generator().manual_seed(1))  # a batch of 4: split
    calls = []
    blocks = kvlab.model.weights.column_blocks_matmul
    monkeypatch.setattr(kvlab.model.weights, "SPLIT_MIN_WEIGHTS", 128 * 128)
    monkeypatch.setattr(kvlab.model.weights, "column_blocks_matmul", lambda *a: calls.append(a[2]) or blocks(*a))
    logits = {}
    for n in (1, 2):
        threads(n)
        cache = model.new_cache(4, 16)
        model.prefill(tokens[:, :-1], cache)
        logits[n] = model.decode_step(tokens[:, -1], cache)
    assert calls and set(calls) == {2}  # only at two threads, and for the large weights
    assert_close(logits[2], logits[1], rtol=1e-5, atol=1e-5)
