"""What every retention policy shares: fixed slots per layer, and a subclass that decides which token each holds.

A policy decides which tokens stay; this module holds the storage that does not depend on the decision. Per layer
there is one store of a fixed number of slots for keys (key-major when float) and one for values, made by
``kvlab.cache.codec.stores.make_store``, so any codec (fp32 ... int4) composes with any policy and this module never
branches on it. A decode step writes its token in place, into the slot of a token the policy has just dropped, and
attends over the slots in use: it reads what the policy keeps, never the history, and a float store hands it views
(nothing is copied).

A multi-token step (a prefill) may need tokens that the step itself evicts: its first queries still see tokens
that its last ones no longer keep. Such a step attends over a *step view*, the kept tokens plus the new ones (as
the store will hold them) gathered into one transient tensor; only then is the store brought to what the policy
keeps.

Slots are not in position order (a ring, an H2O eviction), so a policy masks by the positions its slots hold:
its own rule, and the model layer's sliding window, which ``attend`` is handed and no policy may read past.

MLA's latent (``CacheShape.latent_values``) is one token-major store per layer, read as both key and value (its
first ``latent_values`` channels), as ``kvlab.cache.storage.latent`` stores it: a policy over it keeps latents.

The policies: ``WindowKVCache`` (window + sinks, per-layer windows; ``kvlab.cache.policy.window``) and
``HeavyHitterKVCache`` (H2O; ``kvlab.cache.policy.heavy_hitters``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvlab.cache.base import CacheCapacityError, CacheShape, KVCache, kv_codec
from kvlab.cache.codec.stores import Index, Store, make_store
from kvlab.spec.validation import require_int


class FixedSlotsKVCache(KVCache):
    """A store of fixed slots per layer, for a policy that keeps at most ``keep[layer]`` tokens of each sequence.

    A subclass calls ``_allocate(keep)`` once it knows ``keep`` (``None`` where a layer keeps everything; it then
    needs ``capacity`` slots), and decides which slot each token goes to and which tokens a step sees.
    ``capacity``: the most tokens a sequence may reach (``None``: unbounded, when every layer keeps a bounded
    number); no store is larger. ``codec`` (default: the dtype K/V arrive in): any of ``kvlab.spec.dtypes.KV_DTYPES``,
    ``group_size`` channels per scale.
    """

    _no_rollback = "it reuses an evicted token's slot for a new one, so the tokens a rollback would bring back are gone"

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        codec: str | None = None,
        group_size: int = 32,
    ) -> None:
        super().__init__(shape, batch_size, capacity)
        self.codec = kv_codec(codec, shape)
        self.group_size = group_size
        self._seen = 0
        self._start = 0

    def _allocate(self, keep: Sequence[int | None]) -> None:
        """Make each layer's stores: ``keep[layer]`` slots (``None``: ``capacity``), never more than ``capacity``."""
        if self.capacity is None and None in keep:
            raise ValueError("capacity: None is not allowed when a layer keeps every token; allowed: an integer >= 1")
        self._keep = list(keep)
        slots = [min(bound for bound in (n, self.capacity) if bound is not None) for n in keep]
        latent = self.shape.latent_values is not None
        self._keys = [self._store(n, key_major=not latent) for n in slots]
        self._values = [] if latent else [self._store(n, key_major=False) for n in slots]  # latent: keys' channels
        value_bytes = 0 if latent else self._values[0].slot_bytes
        self._layer_token_bytes = self.n_kv_heads * (self._keys[0].slot_bytes + value_bytes)

    def _store(self, slots: int, key_major: bool) -> Store:
        shape = self.shape
        lead = (self.batch_size, shape.n_kv_heads)
        dtype, device = shape.torch_dtype, shape.device
        return make_store(self.codec, lead, slots, shape.head_dim, dtype, device, key_major, self.group_size)

    # -- shape ---------------------------------------------------------------------------------------------------
    @property
    def n_seen(self) -> int:
        """Tokens each sequence has had, kept or evicted (including the step in progress): the next position."""
        return self._seen

    @property
    def length(self) -> int:
        """Tokens stored per sequence in the layer that keeps the most."""
        return max(self.held(layer) for layer in range(self.n_layers))

    def held(self, layer: int, n_seen: int | None = None) -> int:
        """Tokens ``layer`` holds per sequence once ``n_seen`` tokens (default: so far) have gone through it."""
        n_seen = self._seen if n_seen is None else n_seen
        keep = self._keep[layer]
        return n_seen if keep is None else min(n_seen, keep)

    # -- a step --------------------------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int:
        require_int("n_new", n_new, 1)
        if self.capacity is not None and self._seen + n_new > self.capacity:
            raise CacheCapacityError(
                f"KV cache full: {self._seen} tokens seen, {n_new} more requested, capacity {self.capacity}. "
                "Create the cache with a larger capacity."
            )
        self._start = self._seen
        self._seen += n_new
        return self._start

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept keys and values, ``[B, Hkv, n, D]`` each, in slot order (views for a float codec)."""
        n = self.held(layer)
        k = self._keys[layer].read(n)
        return k, self._value_of(k, lambda: self._values[layer].read(n))

    def reset(self) -> None:
        self._seen = 0
        self._start = 0

    def _write(self, layer: int, index: Index, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``[*selected, D]``) in the slots ``index`` selects from ``[B, Hkv, slots]``."""
        self._keys[layer].write(index, k)
        if self._values:  # a latent's value is its key's first channels, stored once
            self._values[layer].write(index, v)

    def _step_view(self, layer: int, n_old: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``0 .. n_old-1`` followed by this step's tokens as the stores will hold them, copied (the step is
        about to overwrite some of those slots): ``[B, Hkv, n_old + T, D]`` each. ``k``, ``v``: ``[B, T, Hkv, D]``
        as ``append`` takes them."""
        keys = self._keys[layer]
        view_k = torch.cat((keys.read(n_old), keys.as_stored(k.transpose(1, 2))), dim=-2)
        values = None if not self._values else self._values[layer]
        return view_k, self._value_of(
            view_k, lambda: torch.cat((values.read(n_old), values.as_stored(v.transpose(1, 2))), dim=-2)
        )

    def _value_of(self, k: torch.Tensor, read_values: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The values beside keys ``k`` (``[B, Hkv, n, D]``): a latent's first channels (a view), else
        ``read_values()``."""
        r = self.shape.latent_values
        return read_values() if r is None else k[..., :r]

    # -- bytes ---------------------------------------------------------------------------------------------------
    def _tokens_read(self, layer: int, context: int) -> int:
        """Tokens of ``layer`` a decode step over ``context`` tokens reads: every one it holds."""
        return self.held(layer, context)

    def bytes_stored(self) -> int:
        """K/V bytes of the tokens kept now, summed over layers (a local layer holds at most its window)."""
        tokens = sum(self.held(layer) for layer in range(self.n_layers))
        return round(self.batch_size * tokens * self._layer_token_bytes)

    def bytes_allocated(self) -> int:
        """The stores, allocated up front: at most what the policy keeps per layer, never more than ``capacity``."""
        return sum(s.nbytes for s in self._keys + self._values)

    def bytes_read_per_step(self, context: int | None = None) -> int:
        """K/V bytes a decode step reads when its sequences have ``context`` tokens (default: ``n_seen``).

        Each layer reads only what it keeps, ``min(context, keep)`` tokens, not the history.
        """
        context = self._seen if context is None else context
        require_int("context", context, 0)
        tokens = sum(self._tokens_read(layer, context) for layer in range(self.n_layers))
        return round(self.batch_size * tokens * self._layer_token_bytes)
