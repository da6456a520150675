"""The one rule for which cached positions a query sees: the first ``sinks``, plus the ``window`` most recent, within
the model layer's own window. Integers only, so the byte model, the kernels and every cache share it.

A query at position ``q`` sees key position ``k`` when ``k <= q`` (causal) and

- ``q - window < k`` or ``k < sinks`` (the policy: StreamingLLM's sinks and a sliding window; ``window=None``
  keeps every position), and
- ``q - layer_window < k`` (the layer's own sliding window, Gemma-2's local layers; ``None`` for a global layer).
  Sinks do not reach past it: a local layer of the model never reads older than its window.

A policy answers "which positions": the spans a step reads (``spans``), and the positions no later query can see
(``gone``), which a storage may free. Where the kept positions live (a slot ring, blocks of a pool, a slab) is
the storage's business. This module lives below both the byte model and the caches (it imports nothing), so both
use it without an upward import; ``kvlab.cache.policy.keep`` wraps it for tensors and per-layer windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from kvlab.spec.validation import require_int

Span = tuple[int, int]  # half-open: positions start .. end-1
P = TypeVar("P")  # an int or a tensor of positions: the predicate only compares and combines


@dataclass(frozen=True)
class SinksAndWindow:
    """Keep the first ``sinks`` positions and the ``window`` most recent (``window=None``: every position)."""

    window: int | None = None
    sinks: int = 0

    def __post_init__(self) -> None:
        if self.window is not None:
            require_int("window", self.window, 1)
        require_int("sinks", self.sinks, 0)
        if self.sinks and self.window is None:
            raise ValueError(f"sinks: {self.sinks} without a window; allowed: 0, or give window (an integer >= 1) too")

    def visible(self, q: P, k: P, layer_window: int | None = None) -> P:
        """Whether a query at ``q`` sees the key at ``k``: ints give a bool, broadcastable tensors a bool tensor."""
        seen = k <= q
        if self.window is not None:
            seen = seen & ((k > q - self.window) | (k < self.sinks))
        if layer_window is not None:
            seen = seen & (k > q - layer_window)
        return seen

    def spans(self, first: int, end: int, layer_window: int | None = None) -> list[Span]:
        """The positions some query at ``first .. end-1`` sees, as sorted disjoint non-empty spans.

        The first query reaches furthest back, and the last sees up to ``end``. ``spans(n - 1, n)`` is what a
        decode step over ``n`` tokens reads.
        """
        reach = 0 if layer_window is None else max(0, first + 1 - layer_window)
        if self.window is None:
            parts = [(reach, end)]
        else:
            head = min(self.sinks, end)
            parts = [(reach, head), (max(head, reach, first + 1 - self.window), end)]
        return [(lo, hi) for lo, hi in parts if hi > lo]

    def gone(self, first: int) -> Span:
        """The positions no query at ``first`` or later sees, in any layer (after the sinks, before the window of
        the query at ``first``): a storage may free them before such a step. Empty without a window."""
        if self.window is None:
            return (0, 0)
        return (self.sinks, max(self.sinks, first + 1 - self.window))


def count_blocks(spans: list[Span], block_size: int) -> int:
    """How many ``block_size``-token blocks hold a position of ``spans`` (sorted, disjoint), without listing them."""
    count, last = 0, -1  # last: the highest block index counted so far
    for lo, hi in spans:
        first, end = max(lo // block_size, last + 1), math.ceil(hi / block_size)
        count, last = count + max(0, end - first), max(last, end - 1)
    return count


def blocks_inside(span: Span, block_size: int) -> range:
    """Indices of the blocks every position of which lies in ``span``."""
    lo, hi = span
    return range(math.ceil(lo / block_size), hi // block_size)
