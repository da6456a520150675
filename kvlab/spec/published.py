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
- ``hardware_class``: one of ``HARDWARE_CLASSES``; ``bandwidth_fraction_range`` picks rows by it, by batch 1
  against batched, and by 16-bit against quantized weights.

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
HARDWARE_CLASSES = ("datacenter-gpu", "consumer-gpu", "apple", "cpu")
# Weights under this many bytes per parameter are quantized (8 bits or fewer); 16-bit weights take about 2.
QUANTIZED_BYTES_PER_PARAM = 1.5
# A range rests on at least this many publications: one publication's rows share its software and machine, so their
# spread says little about another system of the same kind. A level with fewer falls back to the next.
MIN_SOURCES = 2


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
    hardware_class: str | None = None  # one of HARDWARE_CLASSES
    params: int = 0  # the model's parameters, the input table included (the file's params_b)

    @property
    def batched(self) -> bool:
        return self.batch > 1

    @property
    def quantized(self) -> bool:
        """Weights of 8 bits or fewer: the bytes a step reads per parameter (the input table left out)."""
        return self.weight_bytes / self.params < QUANTIZED_BYTES_PER_PARAM

    @property
    def repository(self) -> str:
        """The publication this row comes from, as its repository (``pytorch/ao``, ``vllm-project/vllm``, ...)."""
        return self.source.split()[1]

    @property
    def label(self) -> str:
        """Which measurement this is, in a few words: model, format, device, batch, context and repository."""
        return (
            f"{self.model} {self.weight_dtype} on {self.device}, batch {self.batch}, {self.context:,} tokens, "
            f"{self.kv_bytes_per_token:,} B of KV per token "
            f"({self.repository}; fraction {self.fraction:.3f})"
        )


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
        hardware_class=_hardware_class(r["hardware_class"], "hardware_class"),
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
        params=round(float(r["params_b"]) * 1e9),
    )


def _hardware_class(value: str, field: str) -> str:
    if value not in HARDWARE_CLASSES:
        raise ValueError(f"{field}: {value!r}; allowed: {', '.join(HARDWARE_CLASSES)}")
    return value


@dataclass(frozen=True)
class FractionRange:
    """The share of nominal bandwidth published systems like the target reached, and which rows say so.

    ``lo``/``hi``: the lowest and highest ``fraction`` of the ``rows`` chosen; ``low_row``/``high_row`` set them.
    ``matched``: what the rows have in common with the target (the first fallback level with enough publications);
    ``wanted``: what was asked for. ``basis`` says all of it in one sentence.
    """

    lo: float
    hi: float
    rows: tuple[PublishedDecode, ...]
    low_row: PublishedDecode
    high_row: PublishedDecode
    wanted: str
    matched: str

    @property
    def basis(self) -> str:
        fallback = ""
        if self.matched != self.wanted:
            fallback = f"fewer than {MIN_SOURCES} publications have rows of {self.wanted}, so "
        return (
            f"{fallback}{len(self.rows)} published decode measurements of {self.matched} reached "
            f"{self.lo:.2f}-{self.hi:.2f} of nominal bandwidth (the slow end is {self.low_row.label}; the fast end "
            f"{self.high_row.label}; kvlab/data/published_decode.csv)"
        )


def _matches(row: PublishedDecode, hardware_class: str | None, batched: bool | None, quantized: bool | None) -> bool:
    """Whether ``row`` has each of the given properties (``None``: any)."""
    return (
        (hardware_class is None or row.hardware_class == hardware_class)
        and (batched is None or row.batched == batched)
        and (quantized is None or row.quantized == quantized)
    )


_CLASS_NAMES = {
    "datacenter-gpu": "datacenter GPUs",
    "consumer-gpu": "consumer GPUs",
    "apple": "Apple silicon",
    "cpu": "CPUs",
}


def _describe(hardware_class: str | None, batched: bool | None, quantized: bool | None) -> str:
    where = "any hardware" if hardware_class is None else _CLASS_NAMES[hardware_class]
    regime = "" if batched is None else (", batched" if batched else ", batch 1")
    weights = "" if quantized is None else (", quantized weights" if quantized else ", 16-bit weights")
    return where + regime + weights


def bandwidth_fraction_range() -> tuple[float, float]:
    """(lowest, highest) share of nominal bandwidth over every published row: the whole spread of the evidence.

    ``kvlab predict`` does not apply this to every target: ``matching_fraction_range`` picks the rows like it.
    """
    fractions = [row.fraction for row in published_decode()]
    return min(fractions), max(fractions)


def matching_fraction_range(
    hardware_class: str | None = None,
    batch: int = 1,
    quantized: bool = False,
    rows: tuple[PublishedDecode, ...] | None = None,
) -> FractionRange:
    """The published rows that match the target, and the spread of bandwidth fractions they reached.

    Systems differ by hardware class (a datacenter GPU's kernels and an Apple GPU's differ; ``None``: not known,
    any class), by regime (batch 1 against batched: a batched step adds work the byte model does not charge), and
    by weight format (quantized weights reach less of the bandwidth: dequantization and fixed per-step costs weigh
    more against fewer bytes). The first of these levels whose rows come from at least ``MIN_SOURCES``
    publications sets the range:

    1. same class, same regime, same weight format
    2. same class, same regime
    3. same class, any regime (another class's batched rows say little about this one: llama.cpp on an M2 Ultra
       at batch 32 reached 0.20 of its bandwidth, far below any GPU row)
    4. any class, same regime, same weight format
    5. any class, same regime
    6. every row

    ``rows``: the measurements to choose from (default: every published row; a leave-one-out test passes the
    others).
    """
    if hardware_class is not None:
        _hardware_class(hardware_class, "hardware_class")
    rows = published_decode() if rows is None else rows
    batched = batch > 1
    wanted = _describe(hardware_class, batched, quantized)
    levels: list[tuple[str, tuple[PublishedDecode, ...]]] = []
    if hardware_class is not None:
        own = tuple(r for r in rows if _matches(r, hardware_class, None, None))
        levels += [
            (wanted, tuple(r for r in own if _matches(r, None, batched, quantized))),
            (_describe(hardware_class, batched, None), tuple(r for r in own if _matches(r, None, batched, None))),
            (_describe(hardware_class, None, None), own),
        ]
    for weights in (quantized, None):
        levels.append(
            (_describe(None, batched, weights), tuple(r for r in rows if _matches(r, None, batched, weights)))
        )
    levels.append((_describe(None, None, None), rows))
    for matched, chosen in levels:
        if len({r.repository for r in chosen}) >= MIN_SOURCES:
            low, high = min(chosen, key=lambda r: r.fraction), max(chosen, key=lambda r: r.fraction)
            return FractionRange(low.fraction, high.fraction, chosen, low, high, wanted, matched)
    raise ValueError(f"rows: from {len({r.repository for r in rows})} publications; allowed: at least {MIN_SOURCES}")


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
