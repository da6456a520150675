"""Decode attention as Triton kernels that read a KV cache's own storage in place (the optional ``kvlab[gpu]``).

One query per sequence over its cached tokens, for the layouts ``kvlab.cache`` keeps, with no copy on the way:

- a slab (``[B, Hkv, D, S]`` key-major keys, ``[B, Hkv, S, Dv]`` values, as ``ContiguousKVCache`` holds them),
- a pool of blocks reached through a block table (``PagedKVCache``): each token's slot is looked up as it is
  loaded, so blocks are read where they lie, never gathered into scratch,
- fp8 / int8 / int4 codes with their fp16 scales (and zero points), grouped along channels (``EncodedStore``) or,
  for KIVI's keys, along tokens (``QuantizedKVCache``): a tile of codes is dequantized in registers, so only the
  compressed bytes cross the memory bus.

All of it is one kernel. What differs between layouts is strides (a pool is a slab whose batch stride is 0 and
whose slots come from the table) and two compile-time switches, the codec and whether there is a table. Each
program takes one (sequence, KV head) and its G query heads, so every K/V byte it loads serves all G of them, and
runs the online softmax over tiles of tokens. Per-row lengths come in as a tensor and the grid depends on shapes
only, so a CUDA graph can capture a step and replay it at any lengths.

Split-K (flash-decoding): at batch 1 there are only ``Hkv`` programs, too few to fill a GPU. ``n_splits > 1`` cuts
each row's context into that many spans, one program each, which write a partial ``(out, lse)``; a second, tiny
kernel merges them exactly as ``kvlab.kernels.reference.merge_partials`` does.

The kernels need CUDA, or Triton's interpreter on the CPU: set ``TRITON_INTERPRET=1`` before this module is
imported (the ``@triton.jit`` decorators read it), which is how the tests run it (about 1e-7 from the torch
reference, about a millisecond per program instance). This module imports nothing from ``kvlab.cache``: it reads
stores by their public attributes (``encoded``, ``data``, ``key_major``, ``stored``), so it sits beside
``kvlab.kernels.reference``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.spec.validation import require_int

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as e:  # pragma: no cover - exercised only where triton is absent
    raise ImportError(
        f'kvlab.kernels.triton needs Triton, which is not installed ({e}); install it with pip install "kvlab[gpu]"'
    ) from e

CODECS: tuple[str, ...] = ("float", "fp8", "int8", "int4")
MIN_SPLIT_TOKENS = 512  # decode() splits a row only into spans at least this long ...
MAX_SPLITS = 32  # ... into at most this many ...
SPLIT_BELOW_PROGRAMS = 128  # ... and only when B x Hkv programs would be fewer than this


@triton.jit
def _tile(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    base,
    stat_base,
    slot,
    chan,
    mask,
    s_slot,
    s_chan,
    t_slot,
    t_chan,
    token_group,
    channel_group,
    CODEC: tl.constexpr,
):
    """fp32 ``[N, C]`` tile of K or V: slots ``slot`` ``[N]``, channels ``chan`` ``[C]``, decoded in registers."""
    s, c = slot[:, None], chan[None, :]
    if CODEC == "int4":  # two codes per byte, element 2i in the low nibble of byte i
        byte = tl.load(codes_ptr + base + s * s_slot + (c // 2) * s_chan, mask=mask, other=0).to(tl.int32)
        codes = ((byte >> ((c % 2) * 4)) & 15).to(tl.float32)
    else:
        codes = tl.load(codes_ptr + base + s * s_slot + c * s_chan, mask=mask, other=0.0).to(tl.float32)
    if CODEC == "float":
        x = codes
    else:
        stats = stat_base + (s // token_group) * t_slot + (c // channel_group) * t_chan
        scale = tl.load(scale_ptr + stats, mask=mask, other=0).to(tl.float32)
        if CODEC == "fp8":
            x = codes * scale
        else:  # scale * code + bias, the codec's own decode (rounding included)
            bias = tl.load(zero_ptr + stats, mask=mask, other=0).to(tl.float32)
            if CODEC == "int8":  # codes stored as u - 128: bias = zero + 128 * scale
                bias = bias + 128.0 * scale
            x = codes * scale + bias
    return x


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    ks_ptr,
    kz_ptr,
    v_ptr,
    vs_ptr,
    vz_ptr,
    table_ptr,
    len_ptr,
    out_ptr,
    lse_ptr,
    sq_b,
    sq_h,
    sq_g,
    sq_d,
    sk_b,
    sk_h,
    sk_s,
    sk_c,
    tk_b,
    tk_h,
    tk_s,
    tk_c,
    sv_b,
    sv_h,
    sv_s,
    sv_c,
    tv_b,
    tv_h,
    tv_s,
    tv_c,
    st_b,
    so_split,
    so_b,
    so_h,
    so_g,
    so_c,
    sl_split,
    sl_b,
    sl_h,
    sl_g,
    n_heads,
    n_groups,
    head_dim,
    value_dim,
    block_size,
    window,
    split_len,
    k_token_group,
    k_channel_group,
    v_token_group,
    v_channel_group,
    CODEC: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (row, KV head, split): its G queries over tokens ``[lo + split * split_len, ..)`` of the row's own
    visible span ``[lo, n)``, ``lo = max(n - window, 0)``; writes the normalized output and the lse."""
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    n = tl.load(len_ptr + b).to(tl.int32)
    start = tl.maximum(n - window, 0) + split * split_len
    end = tl.minimum(start + split_len, n)

    g, d, e = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q_mask = (g < n_groups)[:, None] & (d < head_dim)[None, :]
    q_rows = q_ptr + b.to(tl.int64) * sq_b + h * sq_h
    q = tl.load(q_rows + g[:, None] * sq_g + d[None, :] * sq_d, mask=q_mask, other=0).to(tl.float32)
    k_base, v_base = b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h, b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
    kt_base, vt_base = b.to(tl.int64) * tk_b + h.to(tl.int64) * tk_h, b.to(tl.int64) * tv_b + h.to(tl.int64) * tv_h

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        valid = pos < end
        if PAGED:  # the token's block, looked up as it is loaded: the blocks are read where they lie
            block = tl.load(table_ptr + b.to(tl.int64) * st_b + pos // block_size, mask=valid, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
        else:
            slot = pos.to(tl.int64)
        k_mask = valid[:, None] & (d < head_dim)[None, :]
        k = _tile(
            k_ptr,
            ks_ptr,
            kz_ptr,
            k_base,
            kt_base,
            slot,
            d,
            k_mask,
            sk_s,
            sk_c,
            tk_s,
            tk_c,
            k_token_group,
            k_channel_group,
            CODEC,
        )
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G, N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)  # the first tile always holds a valid token, so m_new is finite
        p = tl.exp(scores - m_new[:, None])
        v_mask = valid[:, None] & (e < value_dim)[None, :]
        v = _tile(
            v_ptr,
            vs_ptr,
            vz_ptr,
            v_base,
            vt_base,
            slot,
            e,
            v_mask,
            sv_s,
            sv_c,
            tv_s,
            tv_c,
            v_token_group,
            v_channel_group,
            CODEC,
        )
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # An empty split (past the row's length) has l_i = 0: it writes zeros and lse = -inf, which weigh nothing.
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out_rows = out_ptr + split.to(tl.int64) * so_split + b.to(tl.int64) * so_b + h * so_h
    out_mask = (g < n_groups)[:, None] & (e < value_dim)[None, :]
    tl.store(out_rows + g[:, None] * so_g + e[None, :] * so_c, out, mask=out_mask)
    lse_rows = lse_ptr + split.to(tl.int64) * sl_split + b.to(tl.int64) * sl_b + h * sl_h
    tl.store(lse_rows + g * sl_g, lse, mask=g < n_groups)


@triton.jit
def _merge_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, n_rows, n_splits, value_dim, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr
):
    """One query row: its ``n_splits`` partial ``(out, lse)`` merged by their lse (``merge_partials``)."""
    row = tl.program_id(0).to(tl.int64)
    s, e = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_DV)
    lse = tl.load(part_lse_ptr + s * n_rows + row, mask=s < n_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row that saw nothing: every weight is exp(-inf) = 0
    weight = tl.exp(lse - top)
    total = tl.sum(weight, 0)
    mask = (s < n_splits)[:, None] & (e < value_dim)[None, :]
    parts = tl.load(part_ptr + (s[:, None] * n_rows + row) * value_dim + e[None, :], mask=mask, other=0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * value_dim + e, out, mask=e < value_dim)
    tl.store(lse_ptr + row, top + tl.log(total))


INTERPRETED = isinstance(_decode_kernel, InterpretedFunction)  # built for Triton's CPU interpreter


def available(device: str | torch.device) -> bool:
    """Whether these kernels can run on tensors on ``device``: CUDA with a GPU present, or the CPU when this
    module was imported with ``TRITON_INTERPRET=1`` and it is still set (Triton reads it as a kernel runs too)."""
    device = torch.device(device)
    if device.type == "cuda":
        return not INTERPRETED and torch.cuda.is_available()
    return device.type == "cpu" and INTERPRETED and triton.knobs.runtime.interpret


@dataclass(frozen=True)
class _Operand:
    """K or V as the kernel reads it: codes (and stats) with strides ``(batch, head, slot, channel)``.

    ``batch`` is 0 for a pool (its rows are reached through the table). Stats are addressed at
    ``(slot // token_group, channel // channel_group)``; codecs without stats pass the codes in their place.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    strides: tuple[int, int, int, int]
    stat_strides: tuple[int, int, int, int]
    token_group: int
    channel_group: int
    codec: str
    dim: int
    slots: int


def _lead_strides(x: torch.Tensor, pooled: bool) -> tuple[int, int]:
    """(batch, head) strides of a ``[B, Hkv, ...]`` slab or a ``[Hkv, ...]`` pool."""
    return (0, x.stride(0)) if pooled else (x.stride(0), x.stride(1))


def _float_operand(name: str, x: torch.Tensor, key_major: bool, pooled: bool) -> _Operand:
    """A float tensor: ``[*lead, dim, slots]`` when ``key_major``, else ``[*lead, slots, dim]``."""
    _require(name, x, 3 if pooled else 4, (torch.float32, torch.float16, torch.bfloat16))
    slot_dim, chan_dim = (-1, -2) if key_major else (-2, -1)
    strides = (*_lead_strides(x, pooled), x.stride(slot_dim), x.stride(chan_dim))
    return _Operand(x, x, x, strides, (0, 0, 0, 0), 1, 1, "float", x.shape[chan_dim], x.shape[slot_dim])


def _encoded_operand(name: str, enc: Any, pooled: bool) -> _Operand:
    """A codec's ``Encoded`` over ``[*lead, slots, dim]`` (``kvlab.cache.codec.codecs``), grouped along slots or dim."""
    codes = enc.payload
    codec = {torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "int4"}.get(codes.dtype, "float")
    _require(f"{name}.payload", codes, 3 if pooled else 4, None)
    if codec == "float":
        return _float_operand(f"{name}.payload", codes, False, pooled)
    ndim = codes.dim()
    if enc.group_dim not in (ndim - 2, ndim - 1):
        raise ValueError(
            f"{name}.group_dim: {enc.group_dim}; allowed: {ndim - 2} (grouped along tokens) or {ndim - 1} "
            "(along channels)"
        )
    token_group, channel_group = (enc.group_size, 1) if enc.group_dim == ndim - 2 else (1, enc.group_size)
    zero = enc.scale if enc.zero is None else enc.zero
    if zero.stride() != enc.scale.stride():
        raise ValueError(f"{name}.zero: strides {zero.stride()}; allowed: the scale's, {enc.scale.stride()}")
    lead = _lead_strides(codes, pooled)
    stat_strides = (*_lead_strides(enc.scale, pooled), enc.scale.stride(-2), enc.scale.stride(-1))
    strides = (*lead, codes.stride(-2), codes.stride(-1))
    return _Operand(
        codes, enc.scale, zero, strides, stat_strides, token_group, channel_group, codec, enc.shape[-1], codes.shape[-2]
    )


def _require(name: str, x: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...] | None) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name}: {x.dim()} dims, shape {tuple(x.shape)}; allowed: {ndim} dims")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {x.dtype}; allowed: {', '.join(map(str, dtypes))}")


def _pow2(n: int) -> int:
    """Tile width for ``n`` (at least 16: ``tl.dot`` takes no narrower operand)."""
    return max(16, triton.next_power_of_2(n))


def _launch(
    q: torch.Tensor,
    k: _Operand,
    v: _Operand,
    lengths: torch.Tensor,
    table: torch.Tensor | None,
    block_size: int,
    window: int | None,
    n_splits: int,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Check the arguments, run the decode kernel (and the merge, when split) and shape the result."""
    _require("q", q, 4, (torch.float32, torch.float16, torch.bfloat16))
    b, hkv, g, d = q.shape
    if k.codec != v.codec:
        raise ValueError(f"values: codec {v.codec!r}; allowed: the keys' codec, {k.codec!r}")
    if k.dim != d:
        raise ValueError(f"keys: {k.dim} channels; allowed: q's head dim, {d}")
    if k.slots != v.slots:
        raise ValueError(f"values: {v.slots} slots; allowed: the keys' {k.slots}")
    if lengths.shape != (b,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths: shape {tuple(lengths.shape)}, {lengths.dtype}; allowed: int32 or int64 [{b}]")
    if window is not None:
        require_int("window", window)
    require_int("n_splits", n_splits)
    tensors = [q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, lengths]
    if table is not None:
        if table.dim() != 2 or table.shape[0] != b or table.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"table: shape {tuple(table.shape)}, {table.dtype}; allowed: int32 or int64 [{b}, blocks per row]"
            )
        require_int("block_size", block_size)
        tensors.append(table)
        span = table.shape[1] * block_size
    else:
        span = k.slots
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"tensors on {sorted({str(t.device) for t in tensors})}; allowed: all on one device")
    if not available(q.device):
        raise ValueError(
            f"q: on {q.device}, where these kernels cannot run; allowed: CUDA, or the CPU with TRITON_INTERPRET=1 "
            "set before kvlab.kernels.triton is imported"
        )

    dv = v.dim
    # Spans of whole tiles, sized from shapes alone (the bound on what a row can see), so the grid is fixed.
    visible = span if window is None else min(span, window)
    block_n = min(64, _pow2(math.ceil(visible / n_splits)))
    split_len = math.ceil(math.ceil(visible / n_splits) / block_n) * block_n
    if n_splits == 1:
        out = torch.empty(1, b, hkv, g, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(1, b, hkv, g, dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(n_splits, b, hkv, g, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(n_splits, b, hkv, g, dtype=torch.float32, device=q.device)
    table_arg = lengths if table is None else table  # never read without a table
    _decode_kernel[(b * hkv, n_splits)](
        q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, table_arg, lengths, out, lse,
        *q.stride(), *k.strides, *k.stat_strides, *v.strides, *v.stat_strides,
        0 if table is None else table.stride(0), *out.stride(), *lse.stride(),
        hkv, g, d, dv, block_size, span if window is None else window, split_len,
        k.token_group, k.channel_group, v.token_group, v.channel_group,
        CODEC=k.codec, PAGED=table is not None,
        BLOCK_G=_pow2(g), BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), BLOCK_N=block_n,
    )  # fmt: skip
    if n_splits == 1:
        out, lse = out[0], lse[0]
    else:
        merged = torch.empty(b, hkv, g, dv, dtype=q.dtype, device=q.device)
        merged_lse = torch.empty(b, hkv, g, dtype=torch.float32, device=q.device)
        n_rows = b * hkv * g
        blocks = {"BLOCK_S": triton.next_power_of_2(n_splits), "BLOCK_DV": triton.next_power_of_2(dv)}
        _merge_kernel[(n_rows,)](out, lse, merged, merged_lse, n_rows, n_splits, dv, **blocks)
        out, lse = merged, merged_lse
    return (out, lse[..., None]) if return_lse else out


def contiguous_decode(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    window: int | None = None,
    n_splits: int = 1,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Grouped decode attention over a slab, each row over its own first ``lengths[b]`` slots.

    ``q``: ``[B, Hkv, G, D]``, scaled. ``k_t``: ``[B, Hkv, D, S]`` (key-major, ``FloatStore.data``). ``v``:
    ``[B, Hkv, S, Dv]``. ``lengths``: int ``[B]``, each at most ``S``. ``window``: only each row's last ``window``
    tokens. ``n_splits``: spans per row (split-K). Returns ``[B, Hkv, G, Dv]`` in q's dtype, and with
    ``return_lse`` also the lse ``[B, Hkv, G, 1]`` (fp32), as ``kvlab.kernels.reference.partial_attention`` does.
    """
    keys, values = _float_operand("k_t", k_t, True, False), _float_operand("v", v, False, False)
    return _launch(q, keys, values, lengths, None, 0, window, n_splits, return_lse)


def paged_decode(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    *,
    window: int | None = None,
    n_splits: int = 1,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Grouped decode attention over a pool of blocks, reading each row's blocks in place through its table.

    ``q``: ``[B, Hkv, G, D]``, scaled. ``k_t``: ``[Hkv, D, n_blocks * block_size]`` (key-major pool, block ``i``
    being slots ``i * block_size ..``). ``v``: ``[Hkv, n_blocks * block_size, Dv]``. ``table``: int ``[B, m]``,
    row ``b``'s block ids in position order (entries past its length are never read, so padding may be any
    value). ``lengths``: int ``[B]``, at most ``m * block_size``. Other arguments and the result as for
    ``contiguous_decode``.
    """
    keys, values = _float_operand("k_t", k_t, True, True), _float_operand("v", v, False, True)
    return _launch(q, keys, values, lengths, table, block_size, window, n_splits, return_lse)


def quantized_decode(
    q: torch.Tensor,
    keys: Any,
    values: Any,
    lengths: torch.Tensor,
    *,
    table: torch.Tensor | None = None,
    block_size: int = 0,
    window: int | None = None,
    n_splits: int = 1,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Grouped decode attention over fp8 / int8 / int4 codes, dequantized in registers.

    ``keys``, ``values``: ``kvlab.cache.codec.codecs.Encoded`` over ``[B, Hkv, S, D]`` (a slab) or, with a ``table``,
    ``[Hkv, n_blocks * block_size, D]`` (a pool): token-major codes (int4 packed to ``ceil(D / 2)`` bytes),
    ``scale`` (and ``zero``) grouped along channels (``EncodedStore``, KIVI's values) or along tokens (KIVI's
    per-channel keys, a slab only). ``q``, ``lengths``, ``table`` and the rest as for ``paged_decode`` (with a
    table) or ``contiguous_decode`` (without). The result equals ``kvlab.kernels.reference.decode_attention`` over the
    codec's own decode, to fp32 rounding.
    """
    pooled = table is not None
    k, v = _encoded_operand("keys", keys, pooled), _encoded_operand("values", values, pooled)
    if pooled and k.token_group > 1:
        raise ValueError("keys.group_dim: grouped along tokens, with a table; allowed: grouped along channels")
    return _launch(q, k, v, lengths, table, block_size, window, n_splits, return_lse)


def default_splits(rows: int, tokens: int) -> int:
    """Split-K spans for ``rows`` (B x Hkv) programs over at most ``tokens`` each: more only when the rows are too
    few to fill a GPU, and never below ``MIN_SPLIT_TOKENS`` tokens a span."""
    if rows >= SPLIT_BELOW_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, tokens // MIN_SPLIT_TOKENS, math.ceil(SPLIT_BELOW_PROGRAMS / rows)))


def decode(
    q: torch.Tensor,
    keys: Any,
    values: Any,
    lengths: torch.Tensor,
    *,
    table: torch.Tensor | None = None,
    block_size: int = 0,
    window: int | None = None,
    n_splits: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over a cache's own stores (``kvlab.cache.codec.stores``), picking the kernel their codec needs.

    ``keys``, ``values``: stores with lead ``(B, Hkv)`` (a slab) or, with ``table`` and ``block_size``, ``(Hkv,)``
    (a pool). ``q``: ``[B, Hkv, G, D]``, scaled; ``lengths``: int ``[B]``. ``n_splits=None`` picks split-K from
    the shapes (``default_splits``). Returns ``[B, Hkv, G, Dv]`` (and the lse ``[B, Hkv, G, 1]``).
    """
    pooled = table is not None
    if keys.encoded != values.encoded:
        raise ValueError("values: encoded and keys not (or the reverse); allowed: both encoded, or both float")
    if keys.encoded:
        k, v = _encoded_operand("keys", keys.stored, pooled), _encoded_operand("values", values.stored, pooled)
    else:
        k = _float_operand("keys.data", keys.data, keys.key_major, pooled)
        v = _float_operand("values.data", values.data, values.key_major, pooled)
    if n_splits is None:
        span = table.shape[1] * block_size if pooled else k.slots
        n_splits = default_splits(q.shape[0] * q.shape[1], span if window is None else min(span, window))
    return _launch(q, k, v, lengths, table, block_size, window, n_splits, return_lse)
