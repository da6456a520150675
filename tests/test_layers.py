"""RMSNorm and RoPE against their textbook formulas: the model computes both in fewer ops than the formulas are
written in (kvlab.model.layers), and these tests hold the fewer ops to the same numbers."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from kvlab.model.layers import RMSNorm, RotaryEmbedding, apply_rope

# fp32 paths that sum or round in another order (a norm through vector_norm against pow+mean; an addcmul's fused
# multiply-add against a multiply then an add) part by a few ulps of values near 1.
FP32_TOL = dict(rtol=1e-6, atol=1e-6)
# bf16 keeps 8 bits: one rounding of a value near 1 is 2^-9 of it; two paths may round once apart.
BF16_TOL = dict(rtol=0, atol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_equals_torch_rms_norm_computed_in_fp32(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    norm.to(dtype)
    # Rows of ordinary size, a row of zeros (only eps keeps it finite) and a row small enough for eps to matter.
    x = torch.cat([torch.randn(2, 3, 96, generator=gen), torch.zeros(1, 3, 96), torch.full((1, 3, 96), 1e-3)])
    x = x.to(dtype)
    expected = F.rms_norm(x.float(), (96,), norm.weight.float(), 1e-5).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    assert_close(out, expected, **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


def _rotate_half_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's RoPE as written there: ``x * cos + rotate_half(x) * sin``, angles ``[pos, D/2]`` twice."""
    freqs = positions.double()[..., None] * inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # [..., T, 1, D]
    x1, x2 = x.double().chunk(2, dim=-1)
    return (x.double() * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()).float()


@pytest.mark.parametrize("ragged", [False, True], ids=["positions [T]", "positions [B, T]"])
def test_rope_equals_the_rotate_half_formula(ragged):
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(16, theta=10000.0)
    x = torch.randn(2, 5, 3, 16, generator=gen)  # [B, T, heads, D]
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]) if ragged else torch.arange(40, 45)
    cos, sin = rope(positions)
    # Angles up to 44 radians: fp32's rounding of the angle itself (2^-24 of 44) is the larger part of the error.
    assert_close(apply_rope(x, cos, sin), _rotate_half_reference(x, positions, rope.inv_freq), rtol=1e-5, atol=2e-5)


def test_rope_span_is_forward_at_those_positions_as_its_table_grows():
    rope = RotaryEmbedding(16, theta=10000.0)
    for start, n in [(0, 3), (3, 1), (5, 4), (100, 1), (7, 20)]:  # grows twice, then reads inside the table
        expected = rope(torch.arange(start, start + n))
        for got, want in zip(rope.span(start, n), expected, strict=True):
            assert_close(got, want, rtol=0, atol=1e-6)


def test_a_rope_table_grown_in_inference_mode_serves_a_forward_with_autograd():
    rope = RotaryEmbedding(16, theta=10000.0)
    with torch.inference_mode():
        rope.span(0, 4)
    x = torch.randn(1, 4, 2, 16, requires_grad=True)
    apply_rope(x, *rope.span(0, 4)).sum().backward()
    assert x.grad is not None
