"""Sliding window + attention sinks (StreamingLLM), and per-layer windows (Gemma-2, gpt-oss local/global layers).

``window=W, sinks=S`` keeps the first S tokens and the W most recent ones (the newest included), so a decode step
reads at most S + W tokens per layer however long the sequence grows. Slots ``0 .. S-1`` hold the sinks; slots
``S .. S+W-1`` are a ring: token ``p >= S`` lives in slot ``S + (p - S) % W``, so each new token overwrites the one
that has just left the window, in place. The slots are stores (``kvlab.cache.codec.stores``), so ``codec="int8"`` keeps
the same window in a quarter of the bytes.

Positions. Keys are stored roped at their original (absolute) positions, which is what ``reserve`` hands the
Decoder. ``positions="original"`` attends with them as they are. ``positions="reassigned"`` is StreamingLLM's
scheme: the kept tokens are numbered ``0 .. n-1`` inside the cache and the newest query sits at ``n-1``. RoPE
scores depend only on the distance between query and key, and the window is contiguous and ends at the query, so
window keys are already at the right distance under both schemes. Only the sinks differ: sink ``j`` must see the
query at distance ``n-1-j`` instead of ``p-j``. Since ``rope(q, a) = rotate(rope(q, b), a - b)``, the step scores
the sinks with the query rotated by ``(n-1) - p``, through the ``rotate`` the attention module hands ``attend``:
nothing is re-roped or rewritten in the cache.

The model's own window. ``attend`` is told the layer's sliding window (``None`` for a global layer). A cache built
with the model's ``layer_windows`` and no sinks keeps exactly that window. Otherwise (a cache window longer than
the layer's, a global cache layer, or sinks older than the layer's window) the step masks by original position,
so it never reads past the model's window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvlab.cache.base import CacheShape, Rotate, check_latent_value
from kvlab.cache.codec.stores import attend_stores
from kvlab.cache.policy.keep import KeepPolicy
from kvlab.cache.policy.slots import FixedSlotsKVCache
from kvlab.kernels.reference import attention_with_probs

POSITIONS = ("original", "reassigned")


class WindowKVCache(FixedSlotsKVCache):
    """Keep the first ``sinks`` tokens and the ``window`` most recent; per layer, or ``None`` for a global layer.

    - ``window``: an int for every layer, or one entry per layer (``None``: a global layer keeping every token,
      which needs ``capacity``). Sinks apply to the local layers. ``model.cfg.layer_windows`` keeps the model's own.
    - ``positions``: ``"original"`` or ``"reassigned"`` (see the module docstring).
    - ``capacity``: the most tokens a sequence may reach; ``None`` (unbounded) when every layer is local.
    - ``codec``, ``group_size``: how the kept K/V are stored (``FixedSlotsKVCache``).
    - An MLA latent's shape (``CacheShape.latent_values``) keeps latents, in original positions.

    A multi-token step gives each of its queries its own window, so it equals feeding its tokens one at a time.
    """

    prefill_is_stepwise = True

    def __init__(
        self,
        shape: CacheShape,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        window: int | Sequence[int | None] | None = None,
        sinks: int = 0,
        positions: str = "original",
        codec: str | None = None,
        group_size: int = 32,
    ) -> None:
        super().__init__(shape, batch_size, capacity, codec=codec, group_size=group_size)
        self.keep = KeepPolicy(window, sinks, self.n_layers)
        if positions not in POSITIONS:
            raise ValueError(f"positions: {positions!r} is not allowed; allowed: {', '.join(map(repr, POSITIONS))}")
        if positions == "reassigned" and shape.latent_values is not None:
            raise ValueError(
                "positions: 'reassigned' with an MLA latent, whose queries are roped in part only; allowed: 'original'"
            )
        self.sinks, self.positions = sinks, positions
        self._allocate([self.keep.bound(layer) for layer in range(self.n_layers)])
        # A multi-token step that evicts tokens its own queries still need attends over this copy instead:
        # keys, values [B, Hkv, n, D] and their positions [n].
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._read_windows: list[int | None] = [None] * self.n_layers  # the model's, as its layers last told them

    # -- which tokens are kept, and where -------------------------------------------------------------------------
    @property
    def windows(self) -> list[int | None]:
        """The policy's window per layer (``None``: a layer keeping every token)."""
        return self.keep.windows

    def _kept_in_order(self, layer: int, n_seen: int) -> torch.Tensor:
        """Positions ``layer`` holds after ``n_seen`` tokens, ascending: ``[n]`` (the sinks, then the window)."""
        return self.keep.kept(layer, n_seen, self.device)

    def _slots(self, layer: int, positions: torch.Tensor | int) -> torch.Tensor | int:
        """The slot of each position (a tensor, or one int): a sink's own index, else its place in the ring."""
        w, s = self.windows[layer], self.sinks
        if w is None:
            return positions
        ring = s + (positions - s) % w
        # A sink (p < s) keeps its own index, which is below every ring slot; a window token's ring slot is <= p.
        return torch.minimum(positions, ring) if isinstance(positions, torch.Tensor) else min(positions, ring)

    def _slot_positions(self, layer: int, n_seen: int) -> torch.Tensor:
        """The original position of the token in each used slot of ``layer`` after ``n_seen`` tokens: ``[n]``."""
        positions = self._kept_in_order(layer, n_seen)
        by_slot = torch.empty_like(positions)
        by_slot[self._slots(layer, positions)] = positions
        return by_slot

    def kept_positions(self, layer: int) -> torch.Tensor:
        """The original position of the token in each used slot of ``layer``: ``[B, Hkv, n]`` (as ``read``)."""
        return self._slot_positions(layer, self._seen).expand(self.batch_size, self.n_kv_heads, -1)

    def _sink_query(self, layer: int, rotate: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor | None:
        """This step's queries rotated to where the sinks must see them (``[B, Hkv, G, T, D]``).

        ``None`` when no query of the step is past its layer's first eviction (there is nothing to correct).
        """
        w = self.windows[layer]
        if self.positions == "original" or w is None or self.sinks == 0 or self._seen <= self.sinks + w:
            return None
        if rotate is None:
            raise ValueError(
                "rotate: None is not allowed with positions='reassigned'; allowed: the attention module's "
                "rotate(shift), which turns the step's queries by RoPE"
            )
        q_positions = torch.arange(self._start, self._seen, device=self.device)
        in_cache = torch.clamp(q_positions, max=self.sinks + w - 1)  # a query is the newest token of its cache
        return rotate(in_cache - q_positions)

    # -- a step --------------------------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int:
        self._views.clear()
        return super().reserve(n_new)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        check_latent_value(self.shape, k, v)
        start, end, t = self._start, self._seen, k.shape[1]
        if t == 1 or self.held(layer, end) == end:  # one slot, or nothing evicted: consecutive slots, in place
            first = self._slots(layer, start)
            slots = (slice(None), slice(None), slice(first, first + t))
            self._write(layer, slots, k.transpose(1, 2), v.transpose(1, 2))
            return
        old = self._slot_positions(layer, start)
        view_k, view_v = self._step_view(layer, old.shape[0], k, v)
        self._views[layer] = (view_k, view_v, torch.cat((old, torch.arange(start, end, device=self.device))))
        new = self._kept_in_order(layer, end)
        new = new[new >= start] - start  # this step's tokens that stay, by their index in the step
        slots = (slice(None), slice(None), self._slots(layer, new + start))
        self._write(layer, slots, k[:, new].transpose(1, 2), v[:, new].transpose(1, 2))

    def attend(
        self, layer: int, q: torch.Tensor, layer_window: int | None = None, rotate: Rotate | None = None
    ) -> torch.Tensor:
        self._read_windows[layer] = layer_window
        keys, r = self._keys[layer], self.shape.latent_values
        values = self._values[layer] if self._values else None  # None: a latent, its own value
        view = self._views.pop(layer, None)
        if view is None and self.held(layer) == self._seen:
            # Nothing evicted yet: slot i holds position i, a slab (the layer's window applied as it reads).
            return attend_stores(q, keys, values, self._seen, self._start, layer_window, value_dim=r)
        sink_q = self._sink_query(layer, rotate)
        q_positions = torch.arange(self._start, self._seen, device=self.device)
        if view is not None:
            k, v, positions = view
            mask = self.keep.mask(layer, q_positions, positions, layer_window)
        else:  # a decode step: the slots hold exactly the sinks and the window the policy keeps
            oldest = 0 if self.sinks else self._seen - self.windows[layer]
            everything_visible = layer_window is None or oldest > self._start - layer_window
            if sink_q is None and everything_visible:  # the common decode step: every kept slot, in any order
                return attend_stores(q, keys, values, self.held(layer), self._start, value_dim=r)
            k, v = self.read(layer)
            positions = self._slot_positions(layer, self._seen)
            mask = None if everything_visible else self.keep.mask(layer, q_positions, positions, layer_window)
        out, _ = attention_with_probs(q, k.transpose(-1, -2), v, mask, sink_q, self.sinks)
        return out

    def reset(self) -> None:
        super().reset()
        self._views.clear()

    def _tokens_read(self, layer: int, context: int) -> int:
        """Every kept token; before the first eviction, only the model window's (as ``attend_stores`` reads)."""
        held, window = self.held(layer, context), self._read_windows[layer]
        return min(held, window) if window is not None and held == context else held
