"""KV codecs: how a float tensor is stored in fewer bytes, and read back.

A codec turns a float tensor into its stored form, an ``Encoded`` (payload, plus per-group scales and zero
points where the codec needs them), and decodes it back to fp32. ``Encoded.nbytes`` counts every byte of the
stored form, so a cache built on a codec reports what it really stores.

Quantizing codecs share one scale (and zero point) among a *group* of ``group_size`` consecutive elements along
one dimension, ``group_dim``. KIVI's choice for a ``[.., tokens, channels]`` cache is to group keys along tokens
(each channel has its own scale: a few key channels carry large outliers) and values along channels (each token
has its own scale). A ragged last group is allowed; it costs a whole group's scale.

Codecs (names and aliases as in ``kvlab.spec.dtypes``):

- ``fp32``, ``fp16``, ``bf16``: a cast, no scales.
- ``fp8``: e4m3 (``torch.float8_e4m3fn``), symmetric, one fp16 scale per group (e4m3's exponent covers the rest).
- ``fp8-tensor``: e4m3 with one scale for the whole tensor, fixed (1.0: vLLM's default without calibration), so
  nothing is stored beside the payload and values past +-448 clip; grouping is ignored.
- ``int8``, ``int4``, ``int2``, ``int1``: asymmetric, one fp16 scale and one fp16 zero point (the group's
  minimum) per group; ``x ~= scale * u + zero`` with the code ``u`` in ``[0, 2**bits - 1]``. int8 codes are
  stored signed (``u - 128``) so that integer matmuls, which take int8, can read them as they are. Narrower codes
  are packed ``8 / bits`` per byte along the last dimension, the first in the lowest bits: int4's element ``2i``
  in the low nibble of byte ``i`` and ``2i + 1`` in the high one, int2's ``4i .. 4i + 3`` in bits 0-1 .. 6-7.
  int2 is KIVI's 2-bit setting; int1 (each number becomes its group's minimum or maximum) is the end of the
  scale, where lesson 09 shows the model's quality break. Both are codecs of ``QuantizedKVCache`` only, not
  ``kvlab.spec.dtypes.KV_DTYPES``: the byte model, ``predict``, ``report``, the per-slot stores and the GPU kernels
  (which tell int4 from int8 by the payload's dtype) cover fp8, int8 and int4; int2 and int1 are here so the
  lesson can run its quality curve down to where it bends.

Scales and zero points are fp16, as in KIVI; they are rounded (zero down, scale up) so that no element of a
group clips, which keeps the int error within ``scale / 2``. Values must lie within fp16's range (+-65504).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvlab.spec.dtypes import canonical_dtype, to_torch
from kvlab.spec.validation import require_int

CODECS: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", "fp8-tensor", "int8", "int4", "int2", "int1")
STATS_DTYPE = torch.float16
_FP16_TINY = 2.0**-24  # the smallest positive fp16: a floor for scales, so a constant group divides safely
_FP8_MAX = 448.0  # largest finite e4m3fn value
INT_BITS: tuple[int, ...] = (8, 4, 2, 1)  # the integer widths IntCodec stores (packed below a byte)


@dataclass(frozen=True)
class Encoded:
    """A tensor in its stored form.

    ``shape``: the logical (decoded) shape. ``payload``: the codes, shaped like ``shape`` except that int4, int2
    and int1 pack the last dimension to ``ceil(n * bits / 8)`` bytes. ``scale``, ``zero``: ``shape`` with
    ``group_dim`` cut to ``ceil(n / group_size)``, or ``None`` for a codec that has none.
    """

    payload: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    shape: tuple[int, ...]
    group_dim: int
    group_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of the stored form: payload, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.payload, self.scale, self.zero) if t is not None)

    def narrow(self, dim: int, start: int, length: int) -> Encoded:
        """A view of elements ``start .. start+length-1`` along ``dim`` (not the last: it may be packed).

        Along ``group_dim``, ``start`` must begin a group, so that the slice owns whole groups' scales.
        """
        dim %= len(self.shape)
        if dim == len(self.shape) - 1:
            raise ValueError("dim: the last dimension may be packed; allowed: any other dimension")
        stats_start, stats_length = start, length
        if dim == self.group_dim:
            if start % self.group_size:
                raise ValueError(f"start: {start}; allowed: a multiple of group_size={self.group_size}")
            stats_start, stats_length = start // self.group_size, math.ceil(length / self.group_size)
        shape = list(self.shape)
        shape[dim] = length
        return Encoded(
            self.payload.narrow(dim, start, length),
            None if self.scale is None else self.scale.narrow(dim, stats_start, stats_length),
            None if self.zero is None else self.zero.narrow(dim, stats_start, stats_length),
            tuple(shape),
            self.group_dim,
            self.group_size,
        )

    def copy_(self, src: Encoded) -> None:
        """Write ``src`` (same shape and grouping) into this storage, e.g. a slice of a preallocated slab."""
        if (src.shape, src.group_dim, src.group_size) != (self.shape, self.group_dim, self.group_size):
            raise ValueError(
                f"src: shape {src.shape} grouped on dim {src.group_dim} by {src.group_size}; allowed: "
                f"shape {self.shape} grouped on dim {self.group_dim} by {self.group_size}"
            )
        for dst, new in ((self.payload, src.payload), (self.scale, src.scale), (self.zero, src.zero)):
            if dst is not None:
                dst.copy_(new)


class Codec(ABC):
    """Encodes float tensors into a stored form and decodes them to fp32."""

    name: str
    bits: float  # payload bits per element
    has_scale: bool = False
    has_zero: bool = False

    def encode(self, x: torch.Tensor, group_dim: int = -1, group_size: int = 32) -> Encoded:
        """``x``: any shape; groups of ``group_size`` consecutive elements along ``group_dim`` share a scale."""
        group_dim = _check_grouping(x.dim(), group_dim, group_size)
        payload, scale, zero = self._encode(x.float(), group_dim, group_size)
        return Encoded(payload, scale, zero, tuple(x.shape), group_dim, group_size)

    @abstractmethod
    def _encode(
        self, x: torch.Tensor, group_dim: int, group_size: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...

    @abstractmethod
    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 tensor of ``enc.shape``; written into ``out`` (fp32, that shape) when given."""

    def empty(
        self, shape: tuple[int, ...], group_dim: int, group_size: int, device: str | torch.device = "cpu"
    ) -> Encoded:
        """Zeroed storage for a tensor of ``shape``: a slab to ``narrow`` and ``copy_`` encoded pieces into."""
        group_dim = _check_grouping(len(shape), group_dim, group_size)
        payload_shape, stats_shape = self._shapes(shape, group_dim, group_size)
        payload = torch.zeros(payload_shape, dtype=self.payload_dtype, device=device)
        scale = torch.zeros(stats_shape, dtype=STATS_DTYPE, device=device) if self.has_scale else None
        zero = torch.zeros(stats_shape, dtype=STATS_DTYPE, device=device) if self.has_zero else None
        return Encoded(payload, scale, zero, tuple(shape), group_dim, group_size)

    def stored_bytes(self, shape: tuple[int, ...], group_dim: int, group_size: int) -> int:
        """Bytes the stored form of a tensor of ``shape`` takes (what ``encode(...).nbytes`` returns)."""
        group_dim = _check_grouping(len(shape), group_dim, group_size)
        payload_shape, stats_shape = self._shapes(shape, group_dim, group_size)
        n_stats = int(self.has_scale) + int(self.has_zero)
        stats_bytes = n_stats * math.prod(stats_shape) * STATS_DTYPE.itemsize
        return math.prod(payload_shape) * self.payload_dtype.itemsize + stats_bytes

    @property
    @abstractmethod
    def payload_dtype(self) -> torch.dtype: ...

    def _shapes(self, shape: tuple[int, ...], group_dim: int, group_size: int) -> tuple[list[int], list[int]]:
        stats_shape = list(shape)
        stats_shape[group_dim] = math.ceil(shape[group_dim] / group_size)
        return list(shape), stats_shape

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class CastCodec(Codec):
    """fp32, fp16 or bf16: the payload is the tensor cast, with no scales."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._dtype = to_torch(name)
        self.bits = 8 * self._dtype.itemsize

    @property
    def payload_dtype(self) -> torch.dtype:
        return self._dtype

    def _encode(self, x, group_dim, group_size):
        return x.to(self.payload_dtype), None, None

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return enc.payload.float()
        return out.copy_(enc.payload)


class Fp8Codec(Codec):
    """e4m3 with one fp16 scale per group, ``scale = absmax / 448`` (rounded up, so nothing overflows)."""

    name, bits, has_scale = "fp8", 8, True

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def _encode(self, x, group_dim, group_size):
        xg = _grouped(x, group_dim, group_size)
        amax = xg.abs().amax(group_dim + 1, keepdim=True)
        scale = _to_fp16(amax / _FP8_MAX, round_up=True)
        scaled = (xg / scale.float()).clamp_(-_FP8_MAX, _FP8_MAX)
        payload = _ungrouped(scaled, group_dim, x.shape[group_dim]).to(torch.float8_e4m3fn)
        return payload, scale.squeeze(group_dim + 1), None

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        return _scale_groups(enc.payload, enc, enc.scale.float(), None, out)


class Fp8TensorCodec(Codec):
    """e4m3 with one per-tensor ``scale`` that is not computed from the data (vLLM's FP8 KV cache with its default
    scales: 1.0 unless calibrated): ``x ~= scale * e4m3(x / scale)``, clipped at +-448 x scale."""

    name, bits = "fp8-tensor", 8

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"scale: {scale!r}; allowed: a number > 0")
        self.scale = float(scale)

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def _encode(self, x, group_dim, group_size):
        return (x / self.scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), None, None

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return enc.payload.float() * self.scale
        return out.copy_(enc.payload).mul_(self.scale)


class IntCodec(Codec):
    """Asymmetric ``bits``-bit integers (``INT_BITS``): ``x ~= scale * u + zero`` per group, ``u`` in
    ``[0, 2**bits - 1]``."""

    has_scale = has_zero = True

    def __init__(self, bits: int) -> None:
        if bits not in INT_BITS:
            raise ValueError(f"bits: {bits!r}; allowed: {', '.join(map(str, INT_BITS))}")
        self.bits = bits
        self.name = f"int{bits}"
        self.qmax = 2**bits - 1
        # int8 codes are stored as u - 128 (see the module docstring); packed codes hold u itself.
        self.offset = 128 if bits == 8 else 0

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    def _shapes(self, shape, group_dim, group_size):
        payload_shape, stats_shape = super()._shapes(shape, group_dim, group_size)
        payload_shape[-1] = math.ceil(payload_shape[-1] * self.bits / 8)
        return payload_shape, stats_shape

    def _encode(self, x, group_dim, group_size):
        xg = _grouped(x, group_dim, group_size)
        zero = _to_fp16(xg.amin(group_dim + 1, keepdim=True), round_up=False)
        span = xg.amax(group_dim + 1, keepdim=True) - zero.float()
        scale = _to_fp16(span / self.qmax, round_up=True)
        u = ((xg - zero.float()) / scale.float()).round_().clamp_(0, self.qmax)
        u = _ungrouped(u, group_dim, x.shape[group_dim])
        payload = (u - self.offset).to(torch.int8) if self.bits == 8 else pack_codes(u.to(torch.uint8), self.bits)
        return payload, scale.squeeze(group_dim + 1), zero.squeeze(group_dim + 1)

    def codes(self, enc: Encoded) -> torch.Tensor:
        """The stored integer codes, unpacked: int8 ``u - 128`` for int8, uint8 ``u`` for the packed widths. Shape
        ``enc.shape``."""
        return enc.payload if self.bits == 8 else unpack_codes(enc.payload, enc.shape[-1], self.bits)

    def bias(self, enc: Encoded) -> torch.Tensor:
        """fp32 per-group term ``b`` with ``x ~= scale * code + b`` for the codes of ``codes()``."""
        return enc.zero.float() + self.offset * enc.scale.float()

    def decode(self, enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        return _scale_groups(self.codes(enc), enc, enc.scale.float(), self.bias(enc), out)


def get_codec(name: str | Codec) -> Codec:
    """The codec called ``name`` (``kvlab.spec.dtypes`` names and aliases), or raise ``ValueError`` listing them."""
    if isinstance(name, Codec):
        return name
    key = canonical_dtype(name, "codec", allowed=CODECS)
    if key == "fp8":
        return Fp8Codec()
    if key == "fp8-tensor":
        return Fp8TensorCodec()
    if key.startswith("int"):
        return IntCodec(int(key[3:]))
    return CastCodec(key)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in ``[0, 2**bits - 1]``, ``[..., n]`` -> ``[..., ceil(n * bits / 8)]`` bytes, ``8 / bits`` codes
    per byte, the first in the lowest bits (a last byte left short is padded with 0). ``bits``: 4, 2 or 1."""
    per_byte = 8 // bits
    pad = -codes.shape[-1] % per_byte
    if pad:
        codes = torch.cat((codes, codes.new_zeros(*codes.shape[:-1], pad)), dim=-1)
    lanes = codes.unflatten(-1, (-1, per_byte))
    packed = lanes[..., 0].clone()
    for i in range(1, per_byte):
        packed |= lanes[..., i] << (bits * i)
    return packed


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """``[..., m]`` bytes -> uint8 codes ``[..., n]``, the inverse of ``pack_codes`` for ``n <= m * 8 / bits``."""
    per_byte, mask = 8 // bits, 2**bits - 1
    # The top lane needs no mask: the shift empties the bits above it (this runs on the cache's hot path).
    lanes = [packed & mask, *((packed >> (bits * i)) & mask for i in range(1, per_byte - 1)), packed >> (8 - bits)]
    return torch.stack(lanes, dim=-1).flatten(-2)[..., :n]


def _check_grouping(ndim: int, group_dim: int, group_size: int) -> int:
    require_int("group_size", group_size)
    if not -ndim <= group_dim < ndim:
        raise ValueError(f"group_dim: {group_dim} is not allowed; allowed: a dimension in [{-ndim}, {ndim - 1}]")
    return group_dim % ndim


def _grouped(x: torch.Tensor, dim: int, group_size: int) -> torch.Tensor:
    """``[.., n, ..]`` -> ``[.., ceil(n / G), G, ..]``; a ragged last group is padded by repeating its last element,
    which leaves the group's min, max and absmax unchanged."""
    pad = -x.shape[dim] % group_size
    if pad:
        x = torch.cat((x, x.narrow(dim, x.shape[dim] - 1, 1).expand(*x.shape[:dim], pad, *x.shape[dim + 1 :])), dim)
    return x.unflatten(dim, (-1, group_size))


def _ungrouped(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """Inverse of ``_grouped``: ``[.., nG, G, ..]`` -> ``[.., n, ..]``."""
    return x.flatten(dim, dim + 1).narrow(dim, 0, n)


def _scale_groups(
    codes: torch.Tensor, enc: Encoded, scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """fp32 ``codes * scale (+ bias)``, the per-group stats broadcast over their groups, written into ``out``.

    The codes are converted into ``out`` first and scaled there in place: on CPU that ran 1.5-2.5x faster than
    one mixed-dtype ``addcmul``, which casts through a temporary and vectorizes its broadcast poorly.
    """
    dim, size, n = enc.group_dim, enc.group_size, enc.shape[enc.group_dim]
    out = torch.empty(enc.shape, dtype=torch.float32, device=codes.device) if out is None else out
    out.copy_(codes)
    if n % size:
        # A ragged last group: spell the stats out per element (a copy the cache's hot path never needs).
        target = out
        scale, bias = (None if t is None else t.repeat_interleave(size, dim).narrow(dim, 0, n) for t in (scale, bias))
    else:
        target = out.unflatten(dim, (-1, size))
        scale, bias = (None if t is None else t.unsqueeze(dim + 1) for t in (scale, bias))
    target.mul_(scale)
    if bias is not None:
        target.add_(bias)
    return out


def _to_fp16(x: torch.Tensor, round_up: bool) -> torch.Tensor:
    """fp32 -> fp16, rounded up (never below ``x``) or down (never above); scales are floored at fp16's smallest."""
    if round_up:
        x = x.clamp_min(_FP16_TINY)
    h = x.to(STATS_DTYPE)
    wrong = h.float() < x if round_up else h.float() > x
    toward = torch.full_like(h, math.inf if round_up else -math.inf)
    return torch.where(wrong, torch.nextafter(h, toward), h)
