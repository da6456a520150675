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

from kvlab.cache.storage.slab import StaticKVCache
from kvlab.spec.validation import require_int

if TYPE_CHECKING:
    from kvlab.model.decoder import Decoder


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
            raise ValueError(f"cache: {type(cache).__name__}; allowed: a kvlab.cache.StaticKVCache")
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
