"""A KV cache that stores keys and values quantized, KIVI-style, and attends over the compressed bytes.

Layout, per layer (``B`` batch, ``Hkv`` KV heads, ``S`` tokens stored, ``D`` head dim):

- the *quantized* part holds the oldest ``Q`` tokens, a multiple of ``key_group_tokens`` (G), encoded by a codec
  from ``kvlab.cache.codec.codecs`` as ``[B, Hkv, Q, D]``. Keys are grouped per channel (G consecutive tokens share
  each channel's scale, KIVI's answer to outlier channels) or, with ``key_quant="per-token"``, per token
  (``group_size`` consecutive channels share a scale). Values are always grouped per token, ``group_size`` channels
  a scale, as in every other cache's codec.
- the *residual* holds the newest ``S - Q`` tokens as they arrived (the shape's dtype), in a ring of
  ``min(capacity, R + G - 1)`` slots. A token stays there until the oldest G residual tokens form a whole group
  and at least ``R`` newer tokens remain; then that group is quantized. So the residual holds ``R .. R + G - 1``
  tokens once the cache is longer than ``R``, and a residual of at least ``capacity`` tokens never quantizes
  anything.

Rolling back (speculative decoding, ``truncate``) must bring back the state the cache had at the shorter length:
the groups quantized since then return to the residual, at full precision, so the ring must still hold them. With
``rollback=m`` the ring has ``m`` more slots, and the cache can forget its newest tokens back to ``m`` below the
longest it has been since the last reset. Without (``m = 0``) it refuses to roll back.

KIVI is a codec *layout* tied to append-only storage: its key groups span ``G`` consecutive tokens, so a token
cannot be encoded alone, nor overwritten or evicted without re-encoding its group. That is why it is a storage of
its own rather than a codec of ``kvlab.cache.codec.stores`` (whose encoded stores encode each slot alone, so any storage
or policy can take them): it composes with no window, eviction or paging policy, and refuses a sliding window.

Three attention paths, chosen by ``attention``:

- ``"chunked"`` reads the compressed bytes a chunk of tokens at a time: it dequantizes that chunk only, into a
  small reused buffer, and merges the chunks' partial attention with a running max and sum (online softmax).
  No full-precision copy of the cache is ever built.
- ``"naive"`` dequantizes the whole cache into a full-precision copy every step, then attends over the copy.
  It stores the same bytes as ``"chunked"`` but moves 8 more bytes per element (the fp32 copy, written and
  read back): for int8, about 9x what it stores.
- ``"int-dot"`` (int8, per-token keys) computes ``q . k`` as integer dot products on the stored int8 codes: q
  is quantized to int8 too (one scale per query head) and each key's scale factors out of its dot product.
  Per-channel keys would need q rescaled for every token group, so they cannot share one integer matmul.
  Values are read chunk by chunk with their per-token scales folded into the softmax weights, so a chunk is
  converted to fp32 but never scaled. Steps with more than one new token (prefill) take the chunked path:
  the integer path is a decode kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from types import ModuleType

import torch

from kvlab.cache.base import CacheShape, Rotate, SlabKVCache, refuse_latent, refuse_window
from kvlab.cache.codec.codecs import Codec, Encoded, IntCodec, get_codec
from kvlab.kernels.fused import fused_kernels
from kvlab.kernels.int8 import folded_value_product, int8_key_scores
from kvlab.kernels.reference import (
    attend_slab,
    decode_attention,
    merge_partials,
    online_softmax_attention,
    partial_attention,
)
from kvlab.spec.validation import require_int

ATTENTION_PATHS: tuple[str, ...] = ("chunked", "naive", "int-dot")
KEY_QUANT: tuple[str, ...] = ("per-channel", "per-token")
_TOKEN_DIM, _CHANNEL_DIM = 2, 3  # dims of a [B, Hkv, S, D] store


class QuantizedKVCache(SlabKVCache):
    """KIVI-style quantized K/V (see the module docstring) behind the ``KVCache`` interface.

    ``codec``: a name from ``kvlab.cache.codec.codecs.CODECS`` (or a ``Codec``). ``group_size``: channels per
    scale (values, and per-token keys), as for every cache. ``key_group_tokens``: G, tokens per key group
    (per-channel keys), which leave the residual together (default: ``group_size``, KIVI's one G). ``residual``: R,
    the newest tokens kept as they arrive (the shape's dtype). ``chunk_size``: tokens per chunk the chunked path
    dequantizes at a time (a multiple of G, so a chunk owns whole key groups). ``rollback``: how many newest tokens
    ``truncate`` may forget (module
    docstring); it costs that many more full-precision ring slots.
    """

    _no_rollback = (
        "the groups quantized since that length have left its full-precision ring; build it with rollback=k + 1"
    )

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        codec: str | Codec = "int8",
        group_size: int = 32,
        key_group_tokens: int | None = None,
        residual: int = 128,
        attention: str = "chunked",
        chunk_size: int = 512,
        key_quant: str = "per-channel",
        rollback: int = 0,
    ) -> None:
        super().__init__(shape, batch_size, capacity)
        refuse_latent(shape, "QuantizedKVCache")
        require_int("group_size", group_size)
        key_group_tokens = group_size if key_group_tokens is None else key_group_tokens
        require_int("key_group_tokens", key_group_tokens)
        require_int("chunk_size", chunk_size)
        require_int("residual", residual, 0)
        require_int("rollback", rollback, 0)
        if chunk_size % key_group_tokens:
            raise ValueError(
                f"chunk_size: {chunk_size} is not allowed; allowed: a positive multiple of "
                f"key_group_tokens={key_group_tokens}"
            )
        self._codec = get_codec(codec)
        self.codec = self._codec.name  # a name, as every cache's ``codec``; the Codec that encodes is ``_codec``
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention: unknown {attention!r}; allowed: {', '.join(ATTENTION_PATHS)}")
        if key_quant not in KEY_QUANT:
            raise ValueError(f"key_quant: unknown {key_quant!r}; allowed: {', '.join(KEY_QUANT)}")
        if attention == "int-dot" and (self._codec.name != "int8" or key_quant != "per-token"):
            raise ValueError(
                f"attention: 'int-dot' needs codec='int8' and key_quant='per-token' (got {self._codec.name!r}, "
                f"{key_quant!r}); allowed: {', '.join(ATTENTION_PATHS)}, with 'int-dot' only for those two"
            )
        self.group_size, self.key_group_tokens = group_size, key_group_tokens
        self.residual, self.chunk_size = residual, chunk_size
        self.attention, self.key_quant, self.rollback = attention, key_quant, rollback
        self._key_dim = _TOKEN_DIM if key_quant == "per-channel" else _CHANNEL_DIM

        capacity, device, n_layers = self.capacity, self.device, shape.n_layers
        store = (batch_size, shape.n_kv_heads, self._n_quantized(capacity), shape.head_dim)
        self._key_group = key_group_tokens if self._key_dim == _TOKEN_DIM else group_size  # along the key's dim
        self._k = [self._codec.empty(store, self._key_dim, self._key_group, device) for _ in range(n_layers)]
        self._v = [self._codec.empty(store, _CHANNEL_DIM, group_size, device) for _ in range(n_layers)]
        self._ring_slots = min(capacity, residual + key_group_tokens - 1 + rollback)
        ring = (n_layers, batch_size, shape.n_kv_heads, self._ring_slots, shape.head_dim)
        self._ring_k = list(torch.zeros(ring, dtype=self.torch_dtype, device=device).unbind(0))
        self._ring_v = list(torch.zeros(ring, dtype=self.torch_dtype, device=device).unbind(0))
        # Scratch, allocated once: the chunked path's per-chunk buffers, or the naive path's full copy of a layer.
        scratch_tokens = capacity if attention == "naive" else chunk_size
        self._scratch = torch.empty(2, batch_size, shape.n_kv_heads, scratch_tokens, shape.head_dim, device=device)
        # A whole group's average: G tokens of one sequence in one layer, K and V, over G.
        g = key_group_tokens
        self._layer_token_bytes = self._quantized_bytes(g) / (g * n_layers * batch_size)
        self.reset()

    # -- the KVCache interface -----------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int:
        super().reserve(n_new)
        self._quant_start, self._quant = self._quant, self._n_quantized(self._length)
        self._longest = max(self._longest, self._length)
        return self._start

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        new = (k.transpose(1, 2), v.transpose(1, 2))  # [B, Hkv, T, D]
        q0, q1, s0 = self._quant_start, self._quant, self._start
        stores = (self._k[layer], self._v[layer])
        rings = (self._ring_k[layer], self._ring_v[layer])
        if q1 > q0:
            # Tokens q0 .. q1-1 complete their groups: encode them (from the ring and, in a long step, from the new
            # tokens) before the new tokens are written, since those may take their ring slots.
            for store, ring, x in zip(stores, rings, new, strict=True):
                leaving = torch.cat([*self._ring_views(ring, q0, min(q1, s0)), x[:, :, : max(q1 - s0, 0)]], dim=2)
                store.narrow(_TOKEN_DIM, q0, q1 - q0).copy_(
                    self._codec.encode(leaving, store.group_dim, store.group_size)
                )
        # Every new token the ring can hold goes in, quantized or not: a rollback may return it to the residual.
        first = max(s0, self._length - self._ring_slots)
        for ring, x in zip(rings, new, strict=True):
            for pos, slot, n in self._ring_spans(first, self._length):
                ring[:, :, slot : slot + n] = x[:, :, pos - s0 : pos - s0 + n]

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        refuse_window(layer_window, "QuantizedKVCache", "use ContiguousKVCache or WindowKVCache with codec=...")
        b, hkv, g, t, d = q.shape
        if self.attention == "naive":
            k, v = self._dequantize_into(layer, *self._scratch[:, :, :, : self._length].unbind(0))
            return attend_slab(q.float(), k.transpose(-1, -2), v, self._start).to(q.dtype)
        if self.attention == "int-dot" and t == 1:
            return self._attend_int_dot(layer, q[..., 0, :].float()).unsqueeze(-2).to(q.dtype)
        fused = fused_kernels(q.device) if t == 1 else None
        # The GPU kernels know fp8 / int8 / int4 codes by their dtype; int2 and int1 (uint8 too) take the chunked path.
        if fused is not None and self._codec.name in fused.CODECS:
            return self._attend_fused(fused, layer, q[..., 0, :].float()).unsqueeze(-2).to(q.dtype)
        # Rows of the query matrix are (query head in group, new token): [B, Hkv, G * T, D].
        q_pos = torch.arange(self._start, self._length, device=q.device).repeat(g)
        out = online_softmax_attention(q.float().reshape(b, hkv, g * t, d), self._chunks(layer), q_pos)
        return out.view(b, hkv, g, t, d).to(q.dtype)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized copies (not views: the stored form is compressed), ``[B, Hkv, S, D]`` fp32 each."""
        shape = (self.batch_size, self.n_kv_heads, self._length, self.head_dim)
        return self._dequantize_into(
            layer, torch.empty(shape, device=self.device), torch.empty(shape, device=self.device)
        )

    def reset(self) -> None:
        super().reset()
        self._quant = self._quant_start = 0
        self._longest = 0  # the most tokens stored since the reset: how far back the ring still reaches

    @property
    def max_rollback(self) -> int:
        if self._longest <= self._ring_slots:  # the ring never wrapped: it holds every token at full precision
            return self._length
        return max(0, min(self._length, self._length - self._longest + self.rollback))

    def can_roll_back(self, n_tokens: int) -> bool:
        return n_tokens <= self.rollback or self._ring_slots >= self.capacity

    def _forget(self, length: int) -> None:
        super()._forget(length)
        self._quant = self._n_quantized(length)
        self._quant_start = min(self._quant_start, self._quant)

    # -- bytes ----------------------------------------------------------------------------------------------------
    def bytes_stored(self) -> int:
        """Payload + scales + zero points of the quantized tokens, plus the full-precision residual tokens."""
        return self._stored_bytes(self._length)

    def bytes_allocated(self) -> int:
        """Every K/V byte this cache holds allocated: stores sized for ``capacity``, the ring, and the scratch
        buffers (the naive path's is a full-precision layer, so it allocates more than the quantized stores)."""
        tensors = [self._scratch, *self._ring_k, *self._ring_v]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(e.nbytes for e in self._k + self._v)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V bytes a decode step moves when it attends over ``context`` tokens (default: ``length``).

        ``"chunked"`` and ``"int-dot"`` read the stored bytes once: what ``bytes_stored`` counts at that context.
        ``"naive"`` reads them too, then writes a full-precision (fp32) copy of every token's K and V and reads
        that copy again to attend: ``stored + 2 * copy``. The copy's write is counted here, with the reads,
        because it is traffic the step's attention costs; ``bytes_written_per_step`` counts what the cache keeps.
        """
        context = self._length if context is None else context
        require_int("context", context, 0)
        stored = self._stored_bytes(context)
        if self.attention != "naive":
            return stored
        copy = 2 * self.n_layers * self.batch_size * self.n_kv_heads * context * self.head_dim * 4
        return stored + 2 * copy

    def bytes_written_per_step(self) -> int:
        """K/V bytes the next decode step stores: its token at full precision in the residual and, on the step that
        completes a group, that group quantized (G-1 steps in G write no quantized bytes, one writes a group's)."""
        n = self._length
        q0, q1 = self._n_quantized(n), self._n_quantized(n + 1)
        residual = self._residual_bytes(1) if n >= q1 else 0
        return self._quantized_bytes(q1) - self._quantized_bytes(q0) + residual

    def _n_quantized(self, n_tokens: int) -> int:
        return max(n_tokens - self.residual, 0) // self.key_group_tokens * self.key_group_tokens

    def _quantized_bytes(self, n_tokens: int) -> int:
        shape = (self.batch_size, self.n_kv_heads, n_tokens, self.head_dim)
        per_layer = self._codec.stored_bytes(shape, self._key_dim, self._key_group) + self._codec.stored_bytes(
            shape, _CHANNEL_DIM, self.group_size
        )
        return self.n_layers * per_layer

    def _residual_bytes(self, n_tokens: int) -> int:
        itemsize = self.torch_dtype.itemsize
        return 2 * self.n_layers * self.batch_size * self.n_kv_heads * n_tokens * self.head_dim * itemsize

    def _stored_bytes(self, n_tokens: int) -> int:
        n_quant = self._n_quantized(n_tokens)
        return self._quantized_bytes(n_quant) + self._residual_bytes(n_tokens - n_quant)

    # -- reading ----------------------------------------------------------------------------------------------------
    def _ring_spans(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Positions ``start .. end-1`` of the residual as ``(position, ring slot, count)`` runs, in position order."""
        spans = []
        while start < end:
            slot = start % self._ring_slots
            n = min(end - start, self._ring_slots - slot)
            spans.append((start, slot, n))
            start += n
        return spans

    def _ring_views(self, ring: torch.Tensor, start: int, end: int) -> list[torch.Tensor]:
        return [ring[:, :, slot : slot + n] for _, slot, n in self._ring_spans(start, end)]

    def _dequantize_into(
        self, layer: int, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write all ``S`` tokens of a layer, fp32, into ``k_out``, ``v_out`` (``[B, Hkv, S, D]``); return them."""
        for store, ring, out in (
            (self._k[layer], self._ring_k[layer], k_out),
            (self._v[layer], self._ring_v[layer], v_out),
        ):
            if self._quant:
                self._codec.decode(store.narrow(_TOKEN_DIM, 0, self._quant), out=out[:, :, : self._quant])
            for pos, slot, n in self._ring_spans(self._quant, self._length):
                out[:, :, pos : pos + n] = ring[:, :, slot : slot + n]
        return k_out, v_out

    def _chunks(self, layer: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """``(k, v, first position)`` per chunk of at most ``chunk_size`` tokens, fp32 ``[B, Hkv, n, D]``, in position
        order. A quantized chunk is decoded into the scratch buffers, which the next chunk overwrites."""
        k_buf, v_buf = self._scratch.unbind(0)
        for start in range(0, self._quant, self.chunk_size):
            n = min(self.chunk_size, self._quant - start)
            k = self._codec.decode(self._k[layer].narrow(_TOKEN_DIM, start, n), out=k_buf[:, :, :n])
            v = self._codec.decode(self._v[layer].narrow(_TOKEN_DIM, start, n), out=v_buf[:, :, :n])
            yield k, v, start
        for pos, slot, n in self._ring_spans(self._quant, self._length):
            for offset in range(0, n, self.chunk_size):
                m = min(self.chunk_size, n - offset)
                window = slice(slot + offset, slot + offset + m)
                yield self._ring_k[layer][:, :, window].float(), self._ring_v[layer][:, :, window].float(), pos + offset

    def _attend_fused(self, kernels: ModuleType, layer: int, qs: torch.Tensor) -> torch.Tensor:
        """The chunked path's decode step on CUDA: ``kvlab.kernels.triton`` reads the quantized tokens' codes in
        place, merged by lse with the residual ring's tokens. ``qs``: ``[B, Hkv, g, D]``, scaled."""
        parts = []
        if self._quant:
            lengths = torch.full((self.batch_size,), self._quant, dtype=torch.int32, device=qs.device)
            parts.append(kernels.quantized_decode(qs, self._k[layer], self._v[layer], lengths, return_lse=True))
        for _, slot, n in self._ring_spans(self._quant, self._length):
            k, v = self._ring_k[layer][:, :, slot : slot + n], self._ring_v[layer][:, :, slot : slot + n]
            parts.append(partial_attention(qs, k.float().transpose(-1, -2), v.float()))
        return functools.reduce(merge_partials, parts)[0]

    def _attend_int_dot(self, layer: int, qs: torch.Tensor) -> torch.Tensor:
        """Decode attention with integer ``q . k`` over the quantized tokens. ``qs``: ``[B, Hkv, g, D]``, scaled."""
        n_quant = self._quant
        keys = self._k[layer].narrow(_TOKEN_DIM, 0, n_quant)
        values = self._v[layer].narrow(_TOKEN_DIM, 0, n_quant)
        ring_k = self._ring_views(self._ring_k[layer], n_quant, self._length)
        ring_v = self._ring_views(self._ring_v[layer], n_quant, self._length)
        residual_scores = [torch.matmul(qs, k.float().transpose(-1, -2)) for k in ring_k]
        key_scores = int8_key_scores(qs, keys.payload, keys.scale, self._codec.bias(keys), keys.group_size)
        p = torch.softmax(torch.cat([key_scores, *residual_scores], dim=-1), dim=-1)
        value_codes = functools.partial(_codes_of_tokens, self._codec, values)
        out = folded_value_product(
            p[..., :n_quant], value_codes, values.scale, self._codec.bias(values), values.group_size, self._scratch[1]
        )
        start = n_quant
        for v in ring_v:
            out.add_(torch.matmul(p[..., start : start + v.shape[2]], v.float()))
            start += v.shape[2]
        return out


def _codes_of_tokens(codec: IntCodec, enc: Encoded, start: int, n: int) -> torch.Tensor:
    """Tokens ``start .. start + n`` of ``enc``'s integer codes, unpacked: ``[B, Hkv, n, D]``."""
    return codec.codes(enc.narrow(_TOKEN_DIM, start, n))


def codec_error(
    codec: str | Codec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group_size: int = 32,
    key_quant: str = "per-channel",
) -> float:
    """Relative error ``||o_codec - o|| / ||o||`` of decode attention when K and V pass through ``codec``.

    ``q``: ``[B, Hkv, g, D]`` (unscaled), ``k``, ``v``: ``[B, Hkv, S, D]``. Every token is quantized (no residual),
    keys grouped as ``key_quant`` says and values per token, as ``QuantizedKVCache`` stores them; ``o`` is the
    fp32 attention over the data as given.
    """
    if key_quant not in KEY_QUANT:
        raise ValueError(f"key_quant: unknown {key_quant!r}; allowed: {', '.join(KEY_QUANT)}")
    codec = get_codec(codec)
    key_dim = _TOKEN_DIM if key_quant == "per-channel" else _CHANNEL_DIM
    k_hat = codec.decode(codec.encode(k, key_dim, group_size))
    v_hat = codec.decode(codec.encode(v, _CHANNEL_DIM, group_size))
    qs = q.float() / math.sqrt(q.shape[-1])
    exact = decode_attention(qs, k.float().transpose(-1, -2), v.float())
    approx = decode_attention(qs, k_hat.transpose(-1, -2), v_hat)
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact))
