"""Published decode measurements, the share of nominal bandwidth real systems reach, and published speculative
decoding results.

``kvlab/data/published_decode.csv`` holds one row per published measurement (gpt-fast, torchao, vLLM, llama.cpp),
each with its source: the model, its weight format, the weight bytes a step reads, the KV shape, the device and its
datasheet bandwidth, batch, context and the measured time per output token. Its conventions (the file's own, kept
here so that the numbers can be re-derived):

- ``weight_bytes`` counts every matrix a step reads, the LM head included, but not an untied input embedding table
  (a step reads one row of it). Quantized formats count their scales (see ``kvlab.roofline.weight_element_bytes``).
- KV bytes per token = 2 x layers x KV heads x head dim x ``kv_dtype_bytes``; a step reads ``batch x context`` of
  them. gpt-fast and torchao read a static cache of prompt + 200 positions every step; llama.cpp's ``tg32`` at
  depth ``d`` is taken at ``d + 16``, the middle of the 32 generated tokens.
- ``fraction`` = bandwidth-bound prediction / measured TPOT: the share of nominal bandwidth the system achieved.

Nothing here trusts the file's derived columns: ``published_decode`` recomputes the prediction and the fraction
from each row's own inputs (tests check that they agree with the printed ones). Imports no torch.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from functools import cache
from importlib import resources

CSV_NAME = "published_decode.csv"
SPECULATIVE_CSV_NAME = "published_speculative.csv"


@dataclass(frozen=True)
class PublishedDecode:
    """One published decode measurement. Times in ms; bandwidth in GB/s (1e9 B/s); ``context`` in tokens.

    ``predicted_tpot_ms`` and ``fraction`` are recomputed from the row's bytes, shape and bandwidth.
    """

    model: str
    weight_dtype: str
    device: str
    bandwidth_gbps: float
    batch: int
    context: int
    measured_tpot_ms: float
    predicted_tpot_ms: float
    fraction: float
    source: str
    weight_bytes: int
    kv_bytes_per_token: int
    caveats: str


@cache
def published_decode() -> tuple[PublishedDecode, ...]:
    """Every row of ``kvlab/data/published_decode.csv``, with prediction and fraction recomputed."""
    text = resources.files("kvlab.data").joinpath(CSV_NAME).read_text()
    return tuple(_row(r) for r in csv.DictReader(io.StringIO(text)))


def _row(r: dict[str, str]) -> PublishedDecode:
    kv_per_token = round(2 * int(r["layers"]) * int(r["kv_heads"]) * int(r["head_dim"]) * float(r["kv_dtype_bytes"]))
    batch, context, bandwidth = int(r["batch"]), int(r["context_tokens"]), float(r["bandwidth_gbps"])
    weight_bytes = int(r["weight_bytes"])
    predicted = (weight_bytes + batch * context * kv_per_token) / (bandwidth * 1e9) * 1e3
    measured = float(r["measured_tpot_ms"])
    return PublishedDecode(
        model=r["model"],
        weight_dtype=r["weight_dtype"],
        device=r["device"],
        bandwidth_gbps=bandwidth,
        batch=batch,
        context=context,
        measured_tpot_ms=measured,
        predicted_tpot_ms=predicted,
        fraction=predicted / measured,
        source=r["source"],
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        caveats=r["caveats"],
    )


def bandwidth_fraction_range() -> tuple[float, float]:
    """(lowest, highest) share of nominal bandwidth over every published row: the whole spread, on purpose.

    Batch-1 rows span about 0.31-0.83 (quantized weights on fast GPUs sit low: dequantization and fixed per-step
    costs weigh more); llama.cpp's batched rows on an M2 Ultra go down to 0.2. A range narrower than all the evidence
    would exclude systems that were measured.
    """
    fractions = [row.fraction for row in published_decode()]
    return min(fractions), max(fractions)


@dataclass(frozen=True)
class PublishedSpeculative:
    """One published speculative-decoding result: a target, its draft, and what the drafts achieved.

    ``acceptance_rate``: accepted / drafted tokens, as serving systems report it (vLLM's "draft acceptance rate",
    llama.cpp's "accept"). It is not the per-draft ``a`` of ``kvlab.roofline.expected_tokens_per_step``: drafts
    after a rejection are never judged, so the rate falls as ``k`` grows at the same ``a``
    (``kvlab.roofline.acceptance_from_rate`` converts). ``tokens_per_step`` (tokens per verify step) and
    ``speedup`` (over the target alone, same system) are ``None`` where the source gives none. ``drafts_per_step``
    is set where a run drafted fewer than ``k`` at some steps (``k`` is then a maximum); such a row's rate does not
    convert to ``a``, since the conversion assumes ``k`` drafts at every step.
    """

    source: str
    target: str
    draft: str
    hardware: str
    task: str
    temperature: str
    batch: int
    k: int
    acceptance_rate: float
    drafts_per_step: float | None  # the mean, where a run drafted fewer than k at some steps; None: k every step
    tokens_per_step: float | None
    speedup: float | None
    caveats: str


@cache
def published_speculative() -> tuple[PublishedSpeculative, ...]:
    """Every row of ``kvlab/data/published_speculative.csv``."""
    text = resources.files("kvlab.data").joinpath(SPECULATIVE_CSV_NAME).read_text()
    return tuple(
        PublishedSpeculative(
            source=r["source"],
            target=r["target"],
            draft=r["draft"],
            hardware=r["hardware"],
            task=r["task"],
            temperature=r["temperature"],
            batch=int(r["batch"]),
            k=int(r["k"]),
            acceptance_rate=float(r["acceptance_rate"]),
            drafts_per_step=float(r["drafts_per_step"]) if r["drafts_per_step"] else None,
            tokens_per_step=float(r["tokens_per_step"]) if r["tokens_per_step"] else None,
            speedup=float(r["speedup"]) if r["speedup"] else None,
            caveats=r["caveats"],
        )
        for r in csv.DictReader(io.StringIO(text))
    )
