"""Request latency with vLLM's definitions and field names, percentile summaries, and the straight-line fit the
course reads slopes from. Torch-free: the engine, the HTTP client (``kvlab.serving.client``) and the measurements
all count with these, and a client must load fast.

Per request of ``n`` output tokens (vLLM ``benchmarks`` definitions):
- TTFT: time from the request's start to its first output token (prefill plus the first sampling).
- ITL: every gap between two consecutive output tokens.
- E2EL: time from the request's start to its last output token.
- TPOT = (E2EL - TTFT) / (n - 1): the mean gap after the first token, one number per request.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

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


@dataclass(frozen=True)
class Fit:
    """Least-squares line ``y = slope * x + intercept`` and its coefficient of determination."""

    slope: float
    intercept: float
    r2: float


def fit_line(x: Sequence[float], y: Sequence[float]) -> Fit:
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"x, y: need two equally long sequences of at least 2 points; got {len(x)} and {len(y)}")
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx == 0:
        raise ValueError("x: all values are equal; allowed: at least two distinct x values")
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx
    intercept = my - slope * mx
    ss_res = sum((b - (slope * a + intercept)) ** 2 for a, b in zip(x, y, strict=True))
    ss_tot = sum((b - my) ** 2 for b in y)
    return Fit(slope, intercept, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


@dataclass(frozen=True)
class RequestTiming:
    """Arrival time of each output token, in seconds since the request started."""

    token_times_s: tuple[float, ...]

    @property
    def ttft_ms(self) -> float:
        return self.token_times_s[0] * 1e3

    @property
    def e2el_ms(self) -> float:
        return self.token_times_s[-1] * 1e3

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in pairwise(self.token_times_s)]

    @property
    def tpot_ms(self) -> float:
        n = len(self.token_times_s)
        if n < 2:
            raise ValueError("TPOT needs at least 2 output tokens")
        return (self.e2el_ms - self.ttft_ms) / (n - 1)
