"""Sliding window + attention sinks (StreamingLLM), and per-layer windows (Gemma-2, gpt-oss local/global layers).

``window=W, sinks=S`` keeps the first S tokens and the W most recent ones (the newest included), so a decode step
reads at most S + W tokens per layer however long the sequence grows. Slots ``0 .. S-1`` hold the sinks; slots
``S .. S+W-1`` are a ring: token ``p >= S`` lives in slot ``S + (p - S) % W``, so each new token overwrites the one
that has just left the window, in place.

Positions. Keys are stored roped at their original (absolute) positions, which is what ``reserve`` hands the
Decoder. ``positions="original"`` attends with them as they are. ``positions="reassigned"`` is StreamingLLM's
scheme: the kept tokens are numbered ``0 .. n-1`` inside the cache and the newest query sits at ``n-1``. RoPE
scores depend only on the distance between query and key, and the window is contiguous and ends at the query, so
window keys are already at the right distance under both schemes. Only the sinks differ: sink ``j`` must see the
query at distance ``n-1-j`` instead of ``p-j``. Since ``rope(q, a) = rotate(rope(q, b), a - b)``, the step scores
the sinks with the query rotated by ``(n-1) - p``: S extra query rotations per step, nothing re-roped or rewritten
in the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvlab.cache.policies import PolicyKVCache, attention_with_probs, require_kv_heads
from kvlab.kernels import causal_attention, decode_attention, window_mask
from kvlab.model import apply_rope
from kvlab.validation import require_int

if TYPE_CHECKING:
    from kvlab.model import Decoder, RotaryEmbedding

POSITIONS = ("original", "reassigned")


class WindowKVCache(PolicyKVCache):
    """Keep the first ``sinks`` tokens and the ``window`` most recent; per layer, or ``None`` for a global layer.

    - ``window``: an int for every layer, or one entry per layer (``None``: a global layer keeping every token,
      which needs ``capacity``). Sinks apply to the local layers.
    - ``positions``: ``"original"`` or ``"reassigned"`` (see the module docstring); ``"reassigned"`` needs the
      model's ``rope`` to rotate queries.
    - ``capacity``: the most tokens a sequence may reach; ``None`` (unbounded) when every layer is local.

    A multi-token step gives each of its queries its own window, so it equals feeding its tokens one at a time.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        window: int | Sequence[int | None],
        sinks: int = 0,
        positions: str = "original",
        rope: RotaryEmbedding | None = None,
        capacity: int | None = None,
        dtype: str | torch.dtype = "fp32",
        device: str | torch.device = "cpu",
    ) -> None:
        require_int("n_layers", n_layers, 1)
        self.windows = _layer_windows(window, n_layers)
        require_int("sinks", sinks, 0)
        if positions not in POSITIONS:
            raise ValueError(f"positions: {positions!r} is not allowed; allowed: {', '.join(map(repr, POSITIONS))}")
        if positions == "reassigned" and rope is None:
            raise ValueError("rope: None is not allowed with positions='reassigned'; allowed: the model's rope")
        self.sinks, self.positions, self._rope = sinks, positions, rope
        keep = [None if w is None else sinks + w for w in self.windows]
        super().__init__(n_layers, batch_size, n_kv_heads, head_dim, keep, capacity, dtype, device)
        # A multi-token step that evicts tokens its own queries still need attends over this copy instead.
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_model(
        cls,
        model: Decoder,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        window: int | Sequence[int | None] | None = None,
        sinks: int = 0,
        positions: str = "original",
        kv_dtype: str | None = None,
    ) -> WindowKVCache:
        """A cache shaped for ``model``; ``window`` defaults to ``model.cfg.layer_windows``.

        The first three arguments are a cache factory's (``make_cache(model, batch_size, capacity)``), so
        ``functools.partial(WindowKVCache.for_model, window=1020, sinks=4)`` is one.
        """
        require_kv_heads(model)
        cfg = model.cfg
        if window is None:
            if cfg.layer_windows is None:
                raise ValueError(
                    f"window: not given and {cfg.name} has no layer_windows; allowed: an integer >= 1, "
                    "or one entry per layer (None for a global layer)"
                )
            window = cfg.layer_windows
        return cls(
            cfg.n_layers,
            batch_size,
            cfg.n_kv_heads,
            cfg.head_dim,
            window,
            sinks=sinks,
            positions=positions,
            rope=model.rope,
            capacity=capacity,
            dtype=kv_dtype or model.dtype,
            device=model.device,
        )

    # -- which tokens are kept, and where -------------------------------------------------------------------------
    def _kept_in_order(self, layer: int, n_seen: int) -> torch.Tensor:
        """Positions ``layer`` holds after ``n_seen`` tokens, ascending: ``[n]`` (the sinks, then the window)."""
        w, device = self.windows[layer], self.device
        if w is None or n_seen <= self.sinks + w:
            return torch.arange(n_seen, device=device)
        return torch.cat((torch.arange(self.sinks, device=device), torch.arange(n_seen - w, n_seen, device=device)))

    def _slots(self, layer: int, positions: torch.Tensor | int) -> torch.Tensor | int:
        """The slot of each position (a tensor, or one int): a sink's own index, else its place in the ring."""
        w, s = self.windows[layer], self.sinks
        if w is None:
            return positions
        ring = s + (positions - s) % w
        # A sink (p < s) keeps its own index, which is below every ring slot; a window token's ring slot is <= p.
        return torch.minimum(positions, ring) if isinstance(positions, torch.Tensor) else min(positions, ring)

    def kept_positions(self, layer: int) -> torch.Tensor:
        """The original position of the token in each used slot of ``layer``: ``[B, Hkv, n]`` (as ``read``)."""
        positions = self._kept_in_order(layer, self._seen)
        by_slot = torch.empty_like(positions)
        by_slot[self._slots(layer, positions)] = positions
        return by_slot.expand(self.batch_size, self.n_kv_heads, -1)

    def _sink_query(self, layer: int, q: torch.Tensor) -> torch.Tensor | None:
        """This step's ``q`` (``[B, T, H, D]``, roped at original positions) rotated to where the sinks must see it.

        ``None`` when no query of the step is past its layer's first eviction (there is nothing to correct).
        """
        w = self.windows[layer]
        if self.positions == "original" or w is None or self.sinks == 0 or self._seen <= self.sinks + w:
            return None
        q_positions = torch.arange(self._start, self._seen, device=self.device)
        in_cache = torch.clamp(q_positions, max=self.sinks + w - 1)  # a query is the newest token of its cache
        cos, sin = self._rope(in_cache - q_positions)
        return apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))

    # -- a step --------------------------------------------------------------------------------------------------
    def reserve(self, n_new: int) -> int:
        self._views.clear()
        return super().reserve(n_new)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start, end, t = self._start, self._seen, k.shape[1]
        k_t, v_slab = self._k_t[layer], self._v[layer]
        if t == 1:
            slot = self._slots(layer, start)
            k_t[..., slot] = k[:, 0]
            v_slab[:, :, slot] = v[:, 0]
            return
        if self.held(layer, end) == end:  # nothing evicted yet: write in place, as the contiguous cache does
            k_t[..., start:end] = k.permute(0, 2, 3, 1)
            v_slab[:, :, start:end] = v.transpose(1, 2)
            return
        old = self._kept_in_order(layer, start)
        view_k_t, view_v = self._step_view(layer, self._slots(layer, old), k, v)
        self._views[layer] = (view_k_t, view_v, torch.cat((old, torch.arange(start, end, device=self.device))))
        new = self._kept_in_order(layer, end)
        new = new[new >= start]  # this step's tokens that stay
        k_t[..., self._slots(layer, new)] = view_k_t[..., new - end]
        v_slab[:, :, self._slots(layer, new)] = view_v[:, :, new - end]

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, t, h, d = q.shape
        sink_q = self._sink_query(layer, q)
        view = self._views.pop(layer, None)
        if view is None:
            n = self.held(layer)
            k_t, v, mask = self._k_t[layer][..., :n], self._v[layer][:, :, :n], None
            if sink_q is None and t == 1:  # the common decode step: the shared kernel, over the kept slots
                return decode_attention(self._grouped(q)[:, :, :, 0], k_t, v).view(b, 1, h, d)
            if sink_q is None:  # a step that evicts nothing its queries need: plain causal attention
                return causal_attention(q.transpose(1, 2), k_t.transpose(-1, -2), v, q_start=self._start).transpose(
                    1, 2
                )
        else:
            k_t, v, k_positions = view
            q_positions = torch.arange(self._start, self._seen, device=self.device)
            mask = window_mask(q_positions, k_positions, self.windows[layer], self.sinks)
        sink_q = None if sink_q is None else self._grouped(sink_q)
        out, _ = attention_with_probs(self._grouped(q), k_t, v, mask, sink_q, self.sinks)
        return self._ungrouped(out)

    def reset(self) -> None:
        super().reset()
        self._views.clear()


def _layer_windows(window: int | Sequence[int | None], n_layers: int) -> list[int | None]:
    """One window per layer from an int or a per-layer sequence, validated."""
    if isinstance(window, int) and not isinstance(window, bool):
        require_int("window", window, 1)
        return [window] * n_layers
    if isinstance(window, (str, bytes)) or not isinstance(window, Sequence) or len(window) != n_layers:
        raise ValueError(
            f"window: {window!r} is not allowed; allowed: an integer >= 1, or {n_layers} entries "
            "(one per layer: an integer >= 1 for a local layer, None for a global one)"
        )
    for i, w in enumerate(window):
        if w is not None:
            require_int(f"window[{i}]", w, 1)
    return list(window)
