"""A decode step recorded once as a CUDA graph and replayed: one launch per step instead of hundreds.

A small model's decode step is several hundred small kernels. At short context each kernel moves few bytes, and
the host's time to launch it (a few µs) is what the step costs: the fixed cost the byte model does not count. A
CUDA graph records the launches once and replays them all in one call.

A graph replays exactly what it recorded: the same kernels, on the same buffers, at the same shapes, with no host
code in between. kvlab's caches keep their length in a Python int and slice their slabs to it, so every step has
new shapes and asks the host where to write. ``StaticKVCache`` keeps the position in a device tensor instead: a
step writes at that position (an index, not a slice), attends over all ``capacity`` slots with the slots not yet
written masked out, and advances the position on the device. Its shapes never change, so ``GraphedDecodeStep``
can record a ``Decoder.decode_step`` over it and replay it at every later length. Where ``kvlab.kernels.triton``
runs (CUDA), a decode step reads only the stored tokens: the kernel takes the lengths as a device tensor and its
grid depends on shapes alone. Elsewhere the step reads all ``capacity`` slots, whatever the length (gpt-fast's
static cache pays the same): size the capacity to the context. ``bytes_read_per_step`` counts what is read.

Why not ``torch.compile(mode="reduce-overhead")``: it records one graph per input shape, and over the growing
caches that is one recording per step; over ``StaticKVCache`` it would also need every layer traced. The graph
here is the same mechanism, used directly, with nothing compiled.

On CPU, ``model.decode_step(tokens, StaticKVCache(...))`` is the same static-shape step, run eagerly; it gives the
logits ``ContiguousKVCache`` gives, to rounding, which is what the replayed graph computes on a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlab.cache.base import FLOAT_DTYPES, CacheCapacityError, CacheShape, KVCache, Rotate, kv_codec, refuse_latent
from kvlab.cache.codec.stores import fused_kernels, make_store
from kvlab.kernels.reference import attention_with_probs, window_mask
from kvlab.spec.validation import require_int

if TYPE_CHECKING:
    from kvlab.model.decoder import Decoder


class StaticKVCache(KVCache):
    """A contiguous slab of ``capacity`` slots whose position lives on the device, so a step has static shapes.

    Keys key-major ``[B, Hkv, D, capacity]``, values ``[B, Hkv, capacity, D]``, in a float ``codec`` (fp32, bf16,
    fp16; default: the dtype K/V arrive in). Every sequence of the batch sits at the same length. ``reserve``
    returns the step's first position as a device ``LongTensor [B]`` (the decoder ropes from it) and advances a
    device counter; the host keeps its own count only to refuse a step past ``capacity``. A layer's sliding window
    is a mask, like the causal one; nothing is sliced.
    """

    _rolls_back = True

    def __init__(
        self, shape: CacheShape, batch_size: int = 1, capacity: int | None = None, *, codec: str | None = None
    ) -> None:
        super().__init__(shape, batch_size, self._required_capacity(capacity, type(self).__name__))
        refuse_latent(shape, type(self).__name__)
        self.codec = kv_codec(codec, shape)
        if self.codec not in FLOAT_DTYPES:
            # An encoded store would decode every slot, all `capacity` of them, into a full-precision copy each step.
            raise ValueError(
                f"codec: {self.codec!r}; allowed: {', '.join(FLOAT_DTYPES)} (for fp8/int8/int4 use ContiguousKVCache)"
            )
        lead, device = (batch_size, shape.n_kv_heads), shape.device
        self._keys = [
            make_store(self.codec, lead, self.capacity, shape.head_dim, shape.torch_dtype, device, True)
            for _ in range(shape.n_layers)
        ]
        self._values = [
            make_store(self.codec, lead, self.capacity, shape.head_dim, shape.torch_dtype, device, False)
            for _ in range(shape.n_layers)
        ]
        self._layer_token_bytes = shape.n_kv_heads * (self._keys[0].slot_bytes + self._values[0].slot_bytes)
        self._slots = torch.arange(self.capacity, device=device)
        self._start = torch.zeros(1, dtype=torch.long, device=device)  # this step's first position
        self._end = torch.zeros(1, dtype=torch.long, device=device)  # positions stored, this step's included
        self._length = 0  # the host's count of the same, for the capacity check and the byte counts
        self._fused = fused_kernels(torch.device(device))

    @property
    def length(self) -> int:
        return self._length

    def claim(self, n_new: int) -> None:
        """The host's half of ``reserve``: refuse a step past ``capacity``, else count its tokens.

        A replayed graph advances the device counter itself; its caller calls only this.
        """
        require_int("n_new", n_new)
        if self._length + n_new > self.capacity:
            raise CacheCapacityError(
                f"KV cache full: {self._length} tokens stored, {n_new} more requested, capacity {self.capacity}. "
                "Create the cache with a larger capacity."
            )
        self._length += n_new

    def reserve(self, n_new: int) -> torch.Tensor:
        self.claim(n_new)
        self._start.copy_(self._end)
        self._end.add_(n_new)
        return self._start.expand(self.batch_size)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``, ``v``: ``[B, T, Hkv, D]``, written at positions ``start .. start + T - 1`` by index."""
        slots = self._start + torch.arange(k.shape[1], device=self._slots.device)
        index = (slice(None), slice(None), slots)
        self._keys[layer].write(index, k.transpose(1, 2))
        self._values[layer].write(index, v.transpose(1, 2))

    def attend(
        self, layer: int, q: torch.Tensor, window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        """``q`` ``[B, Hkv, G, T, D]`` over the causal (and windowed) slots: ``[B, Hkv, G, T, D]``.

        A decode step on CUDA runs the fused kernel over the first ``end`` slots, ``end`` read on the device.
        Otherwise every slot is scored and masked: slot ``s`` holds position ``s``, and the mask, ``[T, capacity]``,
        is built on the device from the device start.
        """
        if self._fused is not None and q.shape[-2] == 1:
            lengths = self._end.to(torch.int32).expand(q.shape[0])
            out = self._fused.decode(q[..., 0, :], self._keys[layer], self._values[layer], lengths, window=window)
            return out.unsqueeze(-2)
        queries = self._start + torch.arange(q.shape[-2], device=q.device)
        mask = window_mask(queries, self._slots, window)
        k_t = self._keys[layer].data  # [B, Hkv, D, capacity]: the key-major store itself
        return attention_with_probs(q, k_t, self._values[layer].read(self.capacity), mask)[0]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._keys[layer].read(self._length), self._values[layer].read(self._length)

    def reset(self) -> None:
        self._forget(0)

    def _forget(self, length: int) -> None:
        # Slots from `length` on keep their bytes; the mask hides them until a step overwrites them.
        self._length = length
        self._end.fill_(length)
        self._start.fill_(length)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V bytes a decode step over ``context`` tokens (default ``length``) reads: those tokens with the fused
        kernel (windows aside), else every one of the ``capacity`` slots, since the step has one shape."""
        context = self.length if context is None else context
        require_int("context", context, 0)
        tokens = context if self._fused is not None else self.capacity
        return round(self.batch_size * tokens * self.bytes_per_token)

    def bytes_allocated(self) -> int:
        return sum(s.nbytes for s in self._keys + self._values)


class GraphedDecodeStep:
    """``model.decode_step(tokens, cache)`` recorded once as a CUDA graph over ``cache``, replayed per call.

    ``step(tokens)``: ``[B]`` (or ``[B, 1]``) token ids on the model's device -> logits ``[B, V]``. The logits are
    the graph's own output buffer, overwritten by the next call: copy them to keep them. Each call advances
    ``cache`` by one token, exactly as ``model.decode_step`` does.

    ``warmup`` eager steps run first, on a side stream (CUDA's rule for what a graph may capture: the lazy
    initialisations of cuBLAS and the allocator happen outside the recording). They and the recording write slots
    past the cache's length and move its counters; both are rolled back, so the cache is as it was given.
    """

    def __init__(self, model: Decoder, cache: StaticKVCache, warmup: int = 2) -> None:
        if model.device.type != "cuda":
            raise ValueError(
                f"model: on {model.device}; allowed: a model on a CUDA device (CUDA graphs are CUDA's). On CPU, "
                "model.decode_step(tokens, StaticKVCache(...)) runs the same static-shape step eagerly"
            )
        if not isinstance(cache, StaticKVCache):
            raise ValueError(f"cache: {type(cache).__name__}; allowed: a kvlab.engine.cuda_graphs.StaticKVCache")
        require_int("warmup", warmup, 1)
        if cache.length + warmup + 1 > cache.capacity:
            raise ValueError(
                f"cache: {cache.length} of {cache.capacity} slots used; allowed: room for the {warmup} warm-up steps "
                "and the recorded one (they are rolled back after)"
            )
        self.model, self.cache = model, cache
        self._tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=model.device)
        length = cache.length
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                model.decode_step(self._tokens, cache)
        torch.cuda.current_stream(model.device).wait_stream(side)
        cache.truncate(length)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._logits = model.decode_step(self._tokens, cache)
        # Recording ran the step's host code (the host count advanced) but none of its kernels.
        cache.truncate(length)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.claim(1)
        self._tokens.copy_(tokens.reshape(self.cache.batch_size, 1))
        self._graph.replay()
        return self._logits
