"""What every KV cache shares: the shape record it is built from, the calls a decode step makes, and its bytes.

A cache knows a shape, not a network. ``CacheShape`` is all it learns of the model: layers, KV heads, head dim,
the dtype K/V arrive in, the device, and for MLA that the values are the keys' first channels. Every cache is
built as ``Cache(shape, batch_size, capacity, *, its own options)``; ``Cache.for_model(model, batch_size,
capacity, **options)`` fills in the shape, so ``functools.partial(WindowKVCache.for_model, window=1020)`` is a
``CacheFactory``.

A decode step talks to its cache in three calls, so that a cache decides both how K/V are stored and how
attention reads them (the layout of the bytes decides how fast a step can stream them):

    start = cache.reserve(n_new)                    # once per step, before any layer writes
    cache.append(layer, k, v)                       # per layer: store the new tokens' K/V
    out = cache.attend(layer, q, layer_window, rotate)    # per layer: the new queries over what the cache keeps

The attention module (``kvlab.model.attention``) owns the model's rules: it scales and groups the queries, and tells
the cache the layer's window. A cache stores, evicts, encodes and reads. Every cache reports the quantities the
course's formula is about: ``bytes_stored()``, ``bytes_read_per_step()`` and ``bytes_written_per_step()``.

Speculative decoding (``kvlab.engine.speculative``) stores K/V for drafted tokens and then keeps only the accepted ones:
``truncate(length)`` forgets the rest. A cache that keeps every token can; one that evicts as it stores (a window,
heavy hitters) cannot, because the tokens a rollback would bring back are gone. ``max_rollback`` says how far a
cache can go back now, and ``truncate`` refuses anything further with ``CacheRollbackError``, changing nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvlab.spec.config import ModelConfig
from kvlab.spec.dtypes import KV_DTYPES, canonical_dtype, to_torch
from kvlab.spec.validation import require_int

if TYPE_CHECKING:
    from typing import Self

FLOAT_DTYPES = ("fp32", "fp16", "bf16")
Rotate = Callable[[torch.Tensor], torch.Tensor]  # queries turned by RoPE through a shift of positions


class CacheCapacityError(RuntimeError):
    """Raised before any write when a step would need more slots than the cache has."""


class CacheRollbackError(ValueError):
    """Raised, before any change, when a cache cannot forget as many of its newest tokens as asked."""


# What a speculative decoder may use, for the error a cache that cannot roll back raises.
ROLLBACK_CACHES = (
    "ContiguousKVCache, LatentKVCache, PagedKVCache, SharedPrefixKVCache, or QuantizedKVCache(rollback=k + 1)"
)


@dataclass(frozen=True)
class CacheShape:
    """What a cache must know of a model.

    ``n_kv_heads`` heads of ``head_dim`` per token and layer, arriving as ``dtype`` (a name) on ``device``.
    ``latent_values``: MLA's latent, seen as one KV head whose value is its key's first ``latent_values`` channels,
    stored once (``None`` for per-head K/V).
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "fp32"
    device: str = "cpu"
    latent_values: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim"):
            require_int(name, getattr(self, name), 1)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "dtype", allowed=FLOAT_DTYPES))
        object.__setattr__(self, "device", str(torch.device(self.device)))
        if self.latent_values is not None:
            require_int("latent_values", self.latent_values, 1)
            if self.n_kv_heads != 1 or self.latent_values > self.head_dim:
                raise ValueError(
                    f"latent_values: {self.latent_values} with {self.n_kv_heads} KV heads of {self.head_dim}; "
                    "allowed: one KV head (the latent) and latent_values <= head_dim"
                )

    @classmethod
    def from_config(cls, cfg: ModelConfig, device: str | torch.device = "cpu") -> CacheShape:
        """The cache shape of a model built from ``cfg`` on ``device``: its KV heads, or for MLA the latent
        ``[c_kv | k_rope]``."""
        device = str(device)
        if cfg.mla is not None:
            m = cfg.mla
            return cls(cfg.n_layers, 1, m.kv_lora_rank + m.qk_rope_head_dim, cfg.dtype, device, m.kv_lora_rank)
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.dtype, device)

    @property
    def value_dim(self) -> int:
        """Channels of one stored value: ``head_dim``, or the latent's first ``latent_values``."""
        return self.head_dim if self.latent_values is None else self.latent_values

    @property
    def elements_per_token(self) -> int:
        """K and V elements one token of one sequence stores in one layer (a latent's once)."""
        return self.head_dim if self.latent_values is not None else 2 * self.n_kv_heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return to_torch(self.dtype)


def kv_codec(codec: str | None, shape: CacheShape) -> str:
    """The codec a cache stores K/V in: ``codec`` by name, or the dtype they arrive in."""
    return canonical_dtype(codec or shape.dtype, "codec", KV_DTYPES)


def refuse_window(layer_window: int | None, cache: str, fix: str) -> None:
    """Raise unless ``layer_window`` is ``None``: for a cache that cannot restrict a step to a sliding window."""
    if layer_window is not None:
        raise ValueError(f"layer_window: {layer_window} (a sliding-window layer) is not supported by {cache}; {fix}")


def refuse_latent(shape: CacheShape, cache: str) -> None:
    """Raise for an MLA latent's shape: for a cache that stores per-head K and V."""
    if shape.latent_values is not None:
        raise ValueError(
            f"shape: an MLA latent (latent_values={shape.latent_values}), which {cache} does not store; allowed: "
            "per-head K/V (an MHA, GQA or MQA model); for MLA use LatentKVCache (or WindowKVCache), in any codec"
        )


def check_latent_value(shape: CacheShape, k: torch.Tensor, v: torch.Tensor) -> None:
    """For an MLA latent's shape, raise unless ``v`` is ``k[..., :latent_values]`` (the same bytes, stored once)."""
    r = shape.latent_values
    if r is not None and (v.data_ptr() != k.data_ptr() or v.shape != k[..., :r].shape):
        raise ValueError(f"v: must be k[..., :{r}]; MLA's value is the latent itself, stored once")


class KVCache(ABC):
    """Per-layer K/V storage for a batch of sequences that advance together.

    Shapes: ``B`` batch, ``T`` new tokens this step, ``S`` tokens stored, ``Hkv`` KV heads, ``G`` query heads per
    KV head, ``D`` head dim. Subclasses set ``_layer_token_bytes``: K and V bytes one token of one sequence takes
    in one layer, as stored (scales included).
    """

    _layer_token_bytes: float
    # A cache that keeps every token it stored can forget the newest (``_forget``) and sets ``_rolls_back``; one
    # that cannot says why, for its CacheRollbackError.
    _rolls_back = False
    _no_rollback = "it keeps no record of the tokens it would have to restore"
    # Whether a multi-token step gives each of its queries the K/V it would read had the tokens come one decode
    # step at a time: true of a cache that keeps every token, or evicts by position alone (a window); not of one
    # whose encoding or eviction depends on how the tokens were grouped into steps.
    prefill_is_stepwise = False
    # A cache whose batch is a choice among the sequences of a pool (PagedKVCache) may start with none.
    _min_batch_size = 1

    def __init__(self, shape: CacheShape, batch_size: int = 1, capacity: int | None = None) -> None:
        if not isinstance(shape, CacheShape):
            raise ValueError(
                f"shape: {type(shape).__name__}; allowed: a kvlab.cache.CacheShape (CacheShape.from_config(cfg, "
                "device), or Cache.for_model(model, ...))"
            )
        require_int("batch_size", batch_size, self._min_batch_size)
        if capacity is not None:
            require_int("capacity", capacity, 1)
        self.shape = shape
        self.n_layers, self.n_kv_heads, self.head_dim = shape.n_layers, shape.n_kv_heads, shape.head_dim
        self.batch_size, self.capacity = batch_size, capacity

    @classmethod
    def for_model(cls, model: Model, batch_size: int = 1, capacity: int | None = None, **options: Any) -> Self:
        """A cache shaped for ``model`` (``CacheShape.from_config(model.cfg, model.device)``); ``options`` are the
        cache's own."""
        return cls(CacheShape.from_config(model.cfg, model.device), batch_size, capacity, **options)

    @staticmethod
    def _required_capacity(capacity: int | None, cache: str) -> int:
        if capacity is None:
            raise ValueError(f"capacity: None is not allowed for {cache}; allowed: an integer >= 1 (tokens)")
        return capacity

    # -- a step --------------------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens stored per sequence (including those reserved by the step in progress)."""

    @abstractmethod
    def reserve(self, n_new: int) -> int | torch.Tensor:
        """Claim ``n_new`` slots for the step about to run; return the position of the first.

        A cache whose sequences sit at different lengths (a ragged batch) returns one start per sequence, a
        ``LongTensor [B]``. Raises ``CacheCapacityError`` (and changes nothing) when the cache cannot hold them.
        """

    @abstractmethod
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the reserved tokens' keys and values for one layer. ``k``, ``v``: ``[B, T, Hkv, D]``."""

    @abstractmethod
    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        """The reserved tokens' queries over what the cache keeps of one layer, causally.

        ``q``: ``[B, Hkv, G, T, D]``, grouped and scaled by the attention module -> ``[B, Hkv, G, T, Dv]``.
        ``layer_window``: the model layer's own sliding window (``None``: global), not a cache policy's; a cache
        applies it or raises ``ValueError``.
        ``rotate(shift)``: ``q`` rotated by RoPE through ``shift`` (``[T]``) positions, for a cache that must score
        some keys at positions other than the query's own.
        """

    @abstractmethod
    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values of one layer as ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]`` (float)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every token; keep the allocation."""

    @property
    def max_rollback(self) -> int:
        """How many of its newest tokens the cache can forget now (``truncate``); 0 for a cache that cannot."""
        return self.length if self._rolls_back else 0

    def can_roll_back(self, n_tokens: int) -> bool:
        """Whether the cache can always forget up to ``n_tokens`` it stored last, however long it grows."""
        return self._rolls_back

    def truncate(self, length: int) -> None:
        """Forget every token from position ``length`` on, in every sequence, as if it had never been stored.

        Raises ``CacheRollbackError`` (changing nothing) unless ``self.length - self.max_rollback <= length <=
        self.length``.
        """
        require_int("length", length, 0)
        if length == self.length:
            return
        if self.max_rollback == 0 and not self.can_roll_back(1):
            raise CacheRollbackError(
                f"{type(self).__name__} cannot roll back: {self._no_rollback}. Caches that can: {ROLLBACK_CACHES}"
            )
        if length > self.length:
            raise CacheRollbackError(f"length: {length}; allowed: at most the {self.length} tokens stored")
        if length < self.length - self.max_rollback:
            raise CacheRollbackError(
                f"length: {length}; allowed: {self.length - self.max_rollback} .. {self.length} ({type(self).__name__}"
                f" can forget at most its newest {self.max_rollback} tokens now)"
            )
        self._forget(length)

    def _forget(self, length: int) -> None:
        """Drop positions ``length ..``; called by ``truncate`` only within ``max_rollback``."""
        raise NotImplementedError(f"{type(self).__name__} sets max_rollback but does not define _forget")

    def fast_fill(self, n_tokens: int, generator: torch.Generator | None = None, chunk: int = 2048) -> None:
        """Append ``n_tokens`` of random K/V to every sequence without running the model.

        For timing sweeps: a decode step's time depends on how many bytes it streams, not on their values (no
        branch depends on the data), so a 32k-token context filled this way costs a step what a real prefill
        would leave behind, without the minutes that prefill takes on a CPU. Values are standard normal (one
        chunk's worth, repeated), so softmax sees ordinary numbers. Goes through ``reserve``/``append``, so a
        policy or codec applies as usual.
        """
        require_int("n_tokens", n_tokens, 0)
        shape = self.shape
        # One chunk of random K/V, drawn once and written at every chunk and layer: drawing normal numbers is far
        # slower than storing them, and a step's time does not depend on which ordinary numbers it streams.
        size = (2, self.batch_size, min(chunk, n_tokens), shape.n_kv_heads, shape.head_dim)
        k_all, v_all = torch.randn(size, generator=generator).to(self.device, self.torch_dtype).unbind(0)
        if shape.latent_values:
            v_all = k_all[..., : shape.latent_values]
        for done in range(0, n_tokens, chunk):
            n = min(chunk, n_tokens - done)
            self.reserve(n)
            for layer in range(self.n_layers):
                self.append(layer, k_all[:, :n], v_all[:, :n])

    @property
    def device(self) -> torch.device:
        """Where the cache's tensors live."""
        return torch.device(self.shape.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype K/V arrive in (what ``append`` takes)."""
        return self.shape.torch_dtype

    # -- bytes ---------------------------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> float:
        """Bytes one token of one sequence takes across all layers (K and V, as stored)."""
        return self.n_layers * self._layer_token_bytes

    @property
    def element_bytes(self) -> float:
        """Bytes per stored K or V element (scales and zero points included)."""
        return self._layer_token_bytes / self.shape.elements_per_token

    def bytes_stored(self) -> int:
        """Bytes of K/V that live tokens occupy now, for the whole batch."""
        return round(self.batch_size * self.length * self.bytes_per_token)

    def bytes_allocated(self) -> int:
        """Bytes reserved for K/V whether used or not, for the whole batch."""
        return round(self.batch_size * self.capacity * self.bytes_per_token)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """Bytes of K/V one decode step reads when it attends over ``context`` tokens (default: ``length``)."""
        context = self.length if context is None else context
        require_int("context", context, 0)
        return round(self.batch_size * context * self.bytes_per_token)

    def bytes_written_per_step(self) -> int:
        """Bytes of K/V one decode step writes: one new token per sequence."""
        return round(self.batch_size * self.bytes_per_token)


class SlabKVCache(KVCache):
    """A cache whose sequences fill slots ``0, 1, 2, ...`` in order and never evict: slot ``i`` holds position ``i``.

    Contiguous, latent and KIVI caches share this bookkeeping: ``_length`` tokens stored, this step's new tokens
    in slots ``_start .. _length - 1``.
    """

    def __init__(self, shape: CacheShape, batch_size: int = 1, capacity: int | None = None) -> None:
        super().__init__(shape, batch_size, self._required_capacity(capacity, type(self).__name__))
        self._length = 0
        self._start = 0

    @property
    def length(self) -> int:
        return self._length

    def reserve(self, n_new: int) -> int:
        """Check the room, then advance: this step's tokens take slots ``_start .. _length - 1``."""
        require_int("n_new", n_new)
        if self._length + n_new > self.capacity:
            raise CacheCapacityError(
                f"KV cache full: {self._length} tokens stored, {n_new} more requested, capacity {self.capacity}. "
                "Create the cache with a larger capacity, or use an eviction policy."
            )
        self._start, self._length = self._length, self._length + n_new
        return self._start

    @property
    def _new_slots(self) -> tuple[slice, slice, slice]:
        """This step's slots in a ``[B, Hkv, slots]`` grid."""
        return slice(None), slice(None), slice(self._start, self._length)

    _rolls_back = True

    def reset(self) -> None:
        self._length = 0
        self._start = 0

    def _forget(self, length: int) -> None:
        # Slots past ``length`` keep their bytes until the next tokens overwrite them; nothing reads them before.
        self._length = length
        self._start = min(self._start, length)


class Model(Protocol):
    """What the cache layer needs of a model (``kvlab.model.Decoder`` is one), so that it never imports the model."""

    cfg: ModelConfig
    device: torch.device

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> KVCache: ...


CacheFactory = Callable[[Model, int, int], KVCache]
"""``make_cache(model, batch_size, capacity) -> KVCache``: how sweeps, quality runs and sessions build caches."""


def default_cache(model: Model, batch_size: int, capacity: int) -> KVCache:
    """The cache factory used when none is given: the model's own ``new_cache``."""
    return model.new_cache(batch_size, capacity)
