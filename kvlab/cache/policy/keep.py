"""Window + sinks as a cache policy: ``kvlab.spec.keep``'s rule, per layer, answering in positions and blocks.

A policy says which positions a step reads and which can go; the storage that holds them (a ring of slots per
layer, ``kvlab.cache.policy.window``, for per-head K/V or MLA's latents; blocks of a pool,
``kvlab.cache.storage.paged``) says where they are. Every answer comes from the one integer rule, so the caches,
the kernels' masks and the byte model (``kvlab.roofline.kv_tokens_read``) cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvlab.kernels.reference import window_mask
from kvlab.spec.keep import SinksAndWindow, Span, blocks_inside
from kvlab.spec.validation import require_int


class KeepPolicy:
    """Per layer, keep the first ``sinks`` positions and the ``windows[layer]`` most recent (``None``: every one).

    ``window``: an int for every layer, or one entry per layer (a model's ``cfg.layer_windows`` keeps its own).
    Sinks apply to the layers with a window. ``layer_window`` arguments are the model layer's own sliding window,
    which the attention module hands a cache's ``attend``; no answer reaches past it.
    """

    def __init__(self, window: int | Sequence[int | None] | None, sinks: int, n_layers: int) -> None:
        self.windows = _layer_windows(window, n_layers)
        require_int("sinks", sinks, 0)
        self.sinks = sinks
        self._rules = [SinksAndWindow(w, sinks if w is not None else 0) for w in self.windows]

    # -- which positions --------------------------------------------------------------------------------------------
    def mask(
        self, layer: int, q_positions: torch.Tensor, k_positions: torch.Tensor, layer_window: int | None
    ) -> torch.Tensor:
        """Which keys each query sees: ``[T]``, ``[..., n]`` -> bool ``[..., T, n]``, True where visible."""
        rule = self._rules[layer]
        return window_mask(q_positions, k_positions, rule.window, rule.sinks, layer_window)

    def spans(self, layer: int, first: int, end: int, layer_window: int | None = None) -> list[Span]:
        """The positions some query at ``first .. end-1`` of ``layer`` sees (``SinksAndWindow.spans``)."""
        return self._rules[layer].spans(first, end, layer_window)

    def kept(self, layer: int, n_seen: int, device: torch.device) -> torch.Tensor:
        """The positions ``layer`` keeps after ``n_seen`` tokens, ascending: ``[n]`` (the sinks, then the window)."""
        return positions_of(self.spans(layer, n_seen - 1, n_seen), device)

    def bound(self, layer: int) -> int | None:
        """The most positions ``layer`` ever keeps (``None``: unbounded)."""
        w = self.windows[layer]
        return None if w is None else self.sinks + w

    # -- which blocks ----------------------------------------------------------------------------------------------
    def blocks_gone(self, first: int, block_size: int) -> range:
        """Table indices of the blocks no query at ``first`` or later sees in any layer (a block holds every
        layer's K/V): they can go back. Every layer's gone span starts after the sinks (or is empty, for a layer
        keeping everything), so the one they all share is the shortest."""
        gone = min((rule.gone(first) for rule in self._rules), key=lambda span: span[1] - span[0])
        return blocks_inside(gone, block_size)


def positions_of(spans: list[Span], device: torch.device) -> torch.Tensor:
    """The positions of ``spans``, in order: ``[n]`` (int64)."""
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in spans] or [torch.arange(0, device=device)])


def _layer_windows(window: int | Sequence[int | None] | None, n_layers: int) -> list[int | None]:
    """One window per layer from an int or a per-layer sequence, validated."""
    if isinstance(window, int) and not isinstance(window, bool):
        require_int("window", window, 1)
        return [window] * n_layers
    if isinstance(window, (str, bytes)) or not isinstance(window, Sequence) or len(window) != n_layers:
        raise ValueError(
            f"window: {window!r} is not allowed; allowed: an integer >= 1, or {n_layers} entries "
            "(one per layer: an integer >= 1 for a local layer, None for a global one; a model's own are "
            "model.cfg.layer_windows)"
        )
    for i, w in enumerate(window):
        if w is not None:
            require_int(f"window[{i}]", w, 1)
    return list(window)
