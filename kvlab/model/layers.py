"""The layers a Llama-style block is built from: RMSNorm, rotary position embeddings (RoPE) and SwiGLU.

Weights are stored ``[in, out]`` and applied through ``kvlab.model.WeightFormat``: ``x @ W`` in the model's weight
precision, by the kernel that reads those bytes fastest (see ``kvlab.model.decoder``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvlab.model.weights import WeightFormat


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.inv_dim = 1 / dim  # a Python float, so that an exported graph holds it as a constant
        # eps as a tensor, so that mean(x**2) + eps is one op (addcmul) rather than three with a Python scalar. A
        # bf16 model stores it in bf16, 0.14% off 1e-5: far below what bf16 rounds its outputs by.
        self.register_buffer("_eps", torch.tensor(eps), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]`` -> ``x / sqrt(mean(x**2) + eps) * weight``, same shape and dtype."""
        # Normalise in fp32, as Llama does, so bf16 models keep the same statistics: the norm is taken in fp32 and
        # a bf16 x times the fp32 inv_rms is promoted to fp32. Five ops, not F.rms_norm: on the CPU that runs as
        # about ten (pow, mean, casts), and a decode step normalises two one-row tensors per layer, where the
        # count of ops, not their arithmetic, sets the time (docs/cpu_performance.md, section F).
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        inv_rms = torch.addcmul(self._eps, norm, norm, value=self.inv_dim).rsqrt_()
        return torch.mul(x, inv_rms).mul_(self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention of Hugging Face's Llama, so its checkpoints load unchanged."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling and scaling.get("rope_type") == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        half = torch.ones(head_dim // 2)
        self.register_buffer("sign", torch.cat((-half, half)), persistent=False)  # rotate-half's, see forward
        # forward() at positions 0, 1, 2, ..., kept for span(): buffers, so that they move with the model.
        self.register_buffer("_cos", None, persistent=False)
        self.register_buffer("_sin", None, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: ``[T]``, or ``[B, T]`` (one row per sequence) -> ``cos``, ``sin``: ``[..., T, 1, D]``
        (broadcast over heads), for ``apply_rope``.

        ``sin``'s first half is negated: rotate-half's sign, folded in here once per step so that ``apply_rope``
        rotates with one ``roll`` per layer instead of a split, a negation and a concatenation.
        """
        return rope_angles(positions, self.inv_freq, self.sign)

    def span(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` at positions ``start .. start+n-1``: ``cos``, ``sin`` ``[n, 1, D]``, views of a table.

        A decode step needs one position's angles; computing them takes about ten small ops, indexing a table
        one. The table doubles when a position lies past its end, so it holds at most twice the positions used.
        """
        end = start + n
        if self._cos is None or self._cos.shape[0] < end:
            size = max(end, 2 * (0 if self._cos is None else self._cos.shape[0]))
            # Not an inference tensor, even when a decode step (inference mode) grows it: a training forward
            # (autograd) may read it later.
            with torch.inference_mode(False):
                self._cos, self._sin = self(torch.arange(size, device=self.inv_freq.device))
        return self._cos[start:end], self._sin[start:end]


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, sign: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward`` with its buffers passed in (``kvlab.model.onnx_step`` binds them as graph inputs,
    so a graph reads the model's frequencies as they are, not as they were when it was exported)."""
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[..., None, :]
    return angles.cos(), angles.sin() * sign


def _llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: slow the low frequencies by ``factor``, keep the high ones, blend between.

    Wavelengths longer than the original context / low_freq_factor are stretched; shorter than
    original / high_freq_factor are untouched; in between, interpolate linearly in original_context / wavelength.
    """
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelength = 2 * torch.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0, 1)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` (``[..., T, heads, D]`` with ``cos``, ``sin``: ``[T, 1, D]`` from
    ``RotaryEmbedding``, or any shapes that broadcast the same way).

    Rotate-half pairs channel ``i`` with ``i + D/2``: ``x * cos + [-x2, x1] * sin``. ``[x2, x1]`` is ``x`` rolled by
    half its width, and the minus sign is already in ``RotaryEmbedding``'s ``sin``.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, weights: WeightFormat | None = None) -> None:
        super().__init__()
        self.weights = WeightFormat() if weights is None else weights
        self.w_gate_up = nn.Parameter(torch.empty(d_model, 2 * d_ff))  # [in, gate | up]
        self.w_down = nn.Parameter(torch.empty(d_ff, d_model))
        self.d_ff = d_ff

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Split by constant sizes, not chunk(2): an ONNX export of chunk computes the halves' sizes from the input's
        # shape in the graph, several more operators a layer when the batch axis is left free (kvlab.model.onnx_step).
        gate, up = self.weights.matmul(x, self.w_gate_up).split([self.d_ff, self.d_ff], dim=-1)
        return self.weights.matmul(F.silu(gate) * up, self.w_down)
