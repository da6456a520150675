"""The codec axis: how one layer's keys (or values) sit in memory, and how they are read back as floats.

A store holds one kind of tensor for a grid of token slots ``[*lead, slots]``, each ``dim`` elements wide:
``lead`` is ``(batch, kv_heads)`` in a slab, ``(kv_heads,)`` in a pool of blocks. A storage (contiguous slab,
paged blocks, MLA latent) decides which slot a token goes to; a policy decides which tokens stay; the store
decides how their bytes are encoded. Every storage and policy is written against this interface, so any of them
composes with any codec.

- ``FloatStore`` (fp32, fp16, bf16): the tensor as it is. Keys can be kept key-major, ``[*lead, dim, slots]``,
  so decode's ``q @ K`` streams contiguous runs of tokens (``kvlab.kernels.reference``); reads are views.
- ``EncodedStore`` (fp8, int8, int4): each slot encoded on its own (``kvlab.cache.codec.codecs``), ``group_size``
  channels sharing a scale, so a slot can be overwritten in place (a window's ring, an H2O eviction, a block)
  without touching its neighbours. Token-major, since int4 packs two channels per byte. Reads decode into fp32.

Every read returns token-major ``[*lead, n, dim]`` floats in the dtype K/V arrive in (a view of a key-major
store is its transpose). A decode step over an encoded store decodes a chunk of slots at a time
(``chunks``), so it moves the stored bytes once and never builds a full-precision copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from kvlab.cache.base import FLOAT_DTYPES
from kvlab.cache.codec.codecs import Encoded, get_codec
from kvlab.kernels.fused import fused_kernels
from kvlab.kernels.reference import attend_slab, online_softmax_attention
from kvlab.spec.dtypes import to_torch

Index = Any  # a tuple of ints, slices and index tensors over the grid's dims, as for a tensor


class Store(ABC):
    """One layer's keys or values for ``[*lead, slots]`` token slots of ``dim`` elements."""

    encoded: bool

    def __init__(self, lead: tuple[int, ...], slots: int, dim: int, dtype: torch.dtype) -> None:
        self.lead, self.slots, self.dim, self.dtype = tuple(lead), slots, dim, dtype

    @abstractmethod
    def write(self, index: Index, x: torch.Tensor) -> None:
        """Store ``x`` (``[*selected, dim]``) in the slots ``index`` selects from the grid."""

    @abstractmethod
    def read(self, end: int, start: int = 0) -> torch.Tensor:
        """Slots ``start .. end-1``: ``[*lead, end - start, dim]``."""

    @abstractmethod
    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Slots by number: ``index`` ``[n]`` (the same for every lead row) or ``[*lead, n]`` -> ``[*lead, n, dim]``."""

    @abstractmethod
    def take_blocks(self, table: torch.Tensor, block_size: int) -> torch.Tensor:
        """Whole blocks of ``block_size`` slots: block ids ``table`` ``[B, m]`` -> ``[B, *lead, m * block_size, dim]``.

        The grid's slots are ``n_blocks x block_size``, block ``b`` being slots ``b * block_size ..``.
        """

    @abstractmethod
    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[..., dim]``) as a read returns it once written: the codec's rounding, in the arriving dtype.

        For a step that attends over new tokens it has not stored (yet): they must carry the rounding the kept
        ones do.
        """

    @abstractmethod
    def move(self, dst: slice, src: slice) -> None:
        """Copy slots ``src`` onto slots ``dst`` as stored (no re-encoding): a copy-on-write."""

    @property
    @abstractmethod
    def slot_bytes(self) -> float:
        """Bytes one slot of one lead row takes, scales and zero points included."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes allocated."""

    def chunks(self, end: int, size: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first slot, [*lead, c, dim])`` for slots ``start .. end-1``, ``size`` at a time."""
        for first in range(start, end, size):
            yield first, self.read(min(first + size, end), first)


class FloatStore(Store):
    """The tensor as it is, in ``storage_dtype``; ``key_major`` keeps it ``[*lead, dim, slots]``."""

    encoded = False

    def __init__(
        self,
        lead: tuple[int, ...],
        slots: int,
        dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        storage_dtype: torch.dtype | None = None,
        key_major: bool = False,
    ) -> None:
        super().__init__(lead, slots, dim, dtype)
        self.key_major = key_major
        size = (*lead, dim, slots) if key_major else (*lead, slots, dim)
        self.data = torch.zeros(size, dtype=storage_dtype or dtype, device=device)
        self._tokens = self.data.transpose(-1, -2) if key_major else self.data  # [*lead, slots, dim], a view

    def write(self, index: Index, x: torch.Tensor) -> None:
        if x.dtype != self.data.dtype:  # an index tensor (index_put_) does not cast, a slice would
            x = x.to(self.data.dtype)
        self._tokens[index] = x

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        return self._arriving(x.to(self.data.dtype))

    def read(self, end: int, start: int = 0) -> torch.Tensor:
        return self._arriving(self._tokens[..., start:end, :])

    def take(self, index: torch.Tensor) -> torch.Tensor:
        if index.dim() == 1:
            return self._arriving(self._tokens.index_select(-2, index))
        return self._arriving(self._tokens.gather(-2, index[..., None].expand(*index.shape, self.dim)))

    def take_blocks(self, table: torch.Tensor, block_size: int) -> torch.Tensor:
        # Gather whole blocks along a middle dim of a 3-d view: on CPU, index_select there ran several times faster
        # than on dim 2 of the 4-d tensor, and for key-major keys it lands in [heads, dim, B, span] in one copy.
        b, m = table.shape
        flat, n_blocks = table.reshape(-1), self.slots // block_size
        if self.key_major:
            rows = self.data.view(-1, n_blocks, block_size).index_select(1, flat)
            return self._arriving(rows.view(*self.lead, self.dim, b, m * block_size).movedim(-2, 0).transpose(-1, -2))
        rows = self.data.view(*self.lead, n_blocks, block_size * self.dim).index_select(-2, flat)
        return self._arriving(rows.view(*self.lead, b, m * block_size, self.dim).movedim(-3, 0))

    def move(self, dst: slice, src: slice) -> None:
        self._tokens[..., dst, :] = self._tokens[..., src, :]

    @property
    def slot_bytes(self) -> float:
        return self.dim * self.data.element_size()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _arriving(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.dtype == self.dtype else x.to(self.dtype)


class EncodedStore(Store):
    """Each slot encoded by ``codec`` on its own, ``group_size`` channels per scale; token-major."""

    encoded = True

    def __init__(
        self,
        lead: tuple[int, ...],
        slots: int,
        dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        codec: str,
        group_size: int = 32,
    ) -> None:
        super().__init__(lead, slots, dim, dtype)
        self.codec = get_codec(codec)
        self.group_size = group_size
        self._store = self.codec.empty((*lead, slots, dim), -1, group_size, device)
        self._parts = [p for p in (self._store.payload, self._store.scale, self._store.zero) if p is not None]
        self._scratch: torch.Tensor | None = None  # fp32 chunk buffer for decode steps, made on first use

    def write(self, index: Index, x: torch.Tensor) -> None:
        encoded = self.codec.encode(x, -1, self.group_size)
        for dst, src in zip(self._parts, _parts(encoded), strict=True):
            dst[index] = src

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(self.codec.encode(x, -1, self.group_size)).to(self.dtype)

    def read(self, end: int, start: int = 0) -> torch.Tensor:
        return self._decoded([p[..., start:end, :] for p in self._parts])

    def take(self, index: torch.Tensor) -> torch.Tensor:
        if index.dim() == 1:
            return self._decoded([p.index_select(-2, index) for p in self._parts])
        return self._decoded([p.gather(-2, index[..., None].expand(*index.shape, p.shape[-1])) for p in self._parts])

    def take_blocks(self, table: torch.Tensor, block_size: int) -> torch.Tensor:
        b, m = table.shape
        flat, n_blocks = table.reshape(-1), self.slots // block_size
        gathered = []
        for p in self._parts:
            rows = p.reshape(*self.lead, n_blocks, block_size * p.shape[-1]).index_select(-2, flat)
            gathered.append(rows.view(*self.lead, b, m * block_size, p.shape[-1]).movedim(-3, 0))
        return self._decoded(gathered)

    def chunks(self, end: int, size: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        """Decoded into one reused fp32 buffer (each chunk overwrites the last)."""
        if self._scratch is None or self._scratch.shape[-2] < size:
            self._scratch = torch.empty(*self.lead, size, self.dim, device=self._store.payload.device)
        for first in range(start, end, size):
            n = min(size, end - first)
            parts = [p[..., first : first + n, :] for p in self._parts]
            chunk = self.codec.decode(self._encoded(parts), out=self._scratch[..., :n, :])
            yield first, chunk if chunk.dtype == self.dtype else chunk.to(self.dtype)

    def move(self, dst: slice, src: slice) -> None:
        for p in self._parts:
            p[..., dst, :] = p[..., src, :]

    @property
    def stored(self) -> Encoded:
        """The stored form itself, ``[*lead, slots, dim]`` grouped along dim: what a fused kernel reads in place."""
        return self._store

    @property
    def slot_bytes(self) -> float:
        return self.codec.stored_bytes((1, self.dim), -1, self.group_size)

    @property
    def nbytes(self) -> int:
        return self._store.nbytes

    def _encoded(self, parts: list[torch.Tensor]) -> Encoded:
        payload, *stats = parts
        scale = stats[0] if self.codec.has_scale else None
        zero = stats[-1] if self.codec.has_zero else None
        shape = (*payload.shape[:-1], self.dim)
        return Encoded(payload, scale, zero, shape, len(shape) - 1, self.group_size)

    def _decoded(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return self.codec.decode(self._encoded(parts)).to(self.dtype)


def _parts(encoded: Encoded) -> list[torch.Tensor]:
    return [p for p in (encoded.payload, encoded.scale, encoded.zero) if p is not None]


def make_store(
    codec: str,
    lead: tuple[int, ...],
    slots: int,
    dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    key_major: bool = False,
    group_size: int = 32,
) -> Store:
    """A store for ``codec`` (a name from ``kvlab.spec.dtypes.KV_DTYPES``): float codecs keep the tensor as it is."""
    if codec in FLOAT_DTYPES:
        return FloatStore(lead, slots, dim, dtype, device, to_torch(codec), key_major)
    return EncodedStore(lead, slots, dim, dtype, device, codec, group_size)


def attend_stores(
    q: torch.Tensor,
    keys: Store,
    values: Store | None,
    n: int,
    q_start: int,
    window: int | None = None,
    value_dim: int | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """This step's queries over slots ``0 .. n-1`` of a slab that holds positions ``0 .. n-1``, the new ones last.

    ``q``: ``[B, Hkv, G, T, D]``, scaled, at positions ``q_start ..``. ``values=None``: the values are the keys'
    first ``value_dim`` channels (MLA's latent). A decode step reads only the last ``window`` slots when given one;
    over an encoded store it decodes ``chunk`` slots at a time and merges them by online softmax, so it moves the
    stored bytes once. On CUDA a decode step runs ``kvlab.kernels.triton`` over the stores in place instead. Returns
    ``[B, Hkv, G, T, Dv]``.
    """
    fused = fused_kernels(q.device) if q.shape[-2] == 1 and values is not None else None
    if fused is not None:
        lengths = torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)
        return fused.decode(q[..., 0, :], keys, values, lengths, window=window).unsqueeze(-2)
    lo = max(0, n - window) if window is not None and q.shape[-2] == 1 else 0
    if q.shape[-2] > 1 or not keys.encoded:
        k = keys.read(n, lo)
        v = k[..., :value_dim] if values is None else values.read(n, lo)
        return attend_slab(q, k.transpose(-1, -2), v, q_start - lo, window)
    key_chunks = keys.chunks(n, chunk, lo)
    if values is None:
        chunks = ((k, k[..., :value_dim], first) for first, k in key_chunks)
    else:
        value_chunks = values.chunks(n, chunk, lo)
        chunks = ((k, v, first) for (first, k), (_, v) in zip(key_chunks, value_chunks, strict=True))
    return online_softmax_attention(q[..., 0, :], chunks).unsqueeze(-2)
