"""Percentile summaries with vLLM's field names, torch-free so that ``kvlab.serving.client`` (a client) loads fast.

``kvlab.measure.sweep`` re-exports these names, where the lessons import them from.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``p`` in [0, 100]."""
    if not values:
        raise ValueError("values: empty; allowed: at least one measurement")
    if not 0 <= p <= 100:
        raise ValueError(f"p: {p}; allowed: 0 <= p <= 100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(name: str, values_ms: Sequence[float]) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_..`` (population), ``p90_..``, ``p99_..``: the field names
    vLLM's bench writes."""
    out = {
        f"mean_{name}_ms": sum(values_ms) / len(values_ms),
        f"median_{name}_ms": percentile(values_ms, 50),
        f"std_{name}_ms": statistics.pstdev(values_ms),
    }
    out.update({f"p{p}_{name}_ms": percentile(values_ms, p) for p in PERCENTILES if p != 50})
    return out


def latency_summaries(requests: Sequence) -> dict[str, float]:
    """``summarize`` of TTFT, TPOT, ITL and E2EL over ``requests`` (anything with ``ttft_ms``, ``tpot_ms`` (``None``
    for a one-token output), ``itl_ms`` and ``e2el_ms``): every ITL gap pooled, as vLLM pools them. A series with
    no value (no request, or only one-token outputs for TPOT) is left out."""
    series = {
        "ttft": [r.ttft_ms for r in requests],
        "tpot": [t for t in (r.tpot_ms for r in requests) if t is not None],
        "itl": [gap for r in requests for gap in r.itl_ms],
        "e2el": [r.e2el_ms for r in requests],
    }
    out: dict[str, float] = {}
    for name, values in series.items():
        if values:
            out.update(summarize(name, values))
    return out
