"""The interface every KV cache layout and policy implements.

A decode step talks to its cache in three calls per step, so that a layout decides both how K/V are stored and
how attention reads them (the layout of the bytes decides how fast a step can stream them):

    start = cache.reserve(n_new)            # once per step, before any layer writes
    cache.append(layer, k, v)               # per layer: store the new tokens' K/V
    out = cache.attend(layer, q)            # per layer: attention of the new queries over the cache

Every cache also reports its bytes, the quantities the course's formula is about:
``bytes_stored()``, ``bytes_read_per_step()`` and ``bytes_written_per_step()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvlab.validation import require_int


class CacheCapacityError(RuntimeError):
    """Raised before any write when a step would need more slots than the cache has."""


class KVCache(ABC):
    """Per-layer K/V storage for a batch of sequences that advance together.

    Shapes: ``B`` batch, ``T`` new tokens this step, ``S`` tokens stored, ``Hkv`` KV heads, ``H`` query heads,
    ``D`` head dim.
    """

    n_layers: int
    batch_size: int
    capacity: int
    n_kv_heads: int
    head_dim: int

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens stored per sequence (including those reserved by the step in progress)."""

    @abstractmethod
    def reserve(self, n_new: int) -> int:
        """Claim ``n_new`` slots for the step about to run; return the position of the first.

        Raises ``CacheCapacityError`` (and changes nothing) when the cache cannot hold them.
        """

    def _claim_slots(self, n_new: int) -> int:
        """``reserve`` for a cache that fills fixed slots in order: check the room, then advance ``_length``.

        Uses ``self._length`` (tokens stored) and sets ``self._start`` (first slot of this step).
        """
        require_int("n_new", n_new)
        if self._length + n_new > self.capacity:
            raise CacheCapacityError(
                f"KV cache full: {self._length} tokens stored, {n_new} more requested, capacity {self.capacity}. "
                "Create the cache with a larger capacity, or use an eviction policy."
            )
        self._start, self._length = self._length, self._length + n_new
        return self._start

    @abstractmethod
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the reserved tokens' keys and values for one layer. ``k``, ``v``: ``[B, T, Hkv, D]``."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of the reserved tokens' queries over every stored token of one layer.

        ``q``: ``[B, T, H, D]`` (RoPE applied) -> ``[B, T, H, D]``.
        """

    @abstractmethod
    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values of one layer as ``[B, Hkv, S, D]`` each (views where the layout allows)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every token; keep the allocation."""

    def fast_fill(self, n_tokens: int, generator: torch.Generator | None = None, chunk: int = 2048) -> None:
        """Append ``n_tokens`` of random K/V to every sequence without running the model.

        For timing sweeps: a decode step's time depends on how many bytes it streams, not on their values (no
        branch depends on the data), so a 32k-token context filled this way costs a step what a real prefill
        would leave behind, without the minutes that prefill takes on a CPU. Values are standard normal, so
        softmax sees ordinary numbers. Goes through ``reserve``/``append``, so a policy or codec applies as usual.
        """
        if n_tokens < 0:
            raise ValueError(f"n_tokens: {n_tokens}; allowed: an integer >= 0")
        device = self.device
        for done in range(0, n_tokens, chunk):
            n = min(chunk, n_tokens - done)
            self.reserve(n)
            shape = (self.batch_size, n, self.n_kv_heads, self.head_dim)
            for layer in range(self.n_layers):
                k, v = (torch.randn(shape, generator=generator).to(device, self.torch_dtype) for _ in range(2))
                self.append(layer, k, v)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the cache's tensors live."""

    @property
    @abstractmethod
    def torch_dtype(self) -> torch.dtype:
        """The dtype K/V arrive in (what ``append`` takes)."""

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes one token of one sequence takes across all layers (K and V)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.element_bytes

    @property
    @abstractmethod
    def element_bytes(self) -> float:
        """Bytes per stored K or V element."""

    def bytes_stored(self) -> int:
        """Bytes of K/V that live tokens occupy now, for the whole batch."""
        return round(self.batch_size * self.length * self.kv_bytes_per_token)

    def bytes_allocated(self) -> int:
        """Bytes reserved for K/V whether used or not, for the whole batch."""
        return round(self.batch_size * self.capacity * self.kv_bytes_per_token)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """Bytes of K/V one decode step reads when it attends over ``context`` tokens (default: ``length``)."""
        context = self.length if context is None else context
        return round(self.batch_size * context * self.kv_bytes_per_token)

    def bytes_written_per_step(self) -> int:
        """Bytes of K/V one decode step writes: one new token per sequence."""
        return round(self.batch_size * self.kv_bytes_per_token)
