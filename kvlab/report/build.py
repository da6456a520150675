"""The figures of ``kvlab report``, as plain data (``report.json``): one team's model on one GPU, at their context
and batch. ``kvlab.report.render`` turns them into a page. Every byte count and
TPOT comes from ``kvlab.roofline.predict`` and ``kvlab.roofline.speculate``, the functions
``kvlab predict`` calls, and each mitigation records the ``kvlab predict`` flags that reproduce its figures.

Quality costs cite what the course measured: the shipped checkpoints' records (``kvlab/data/kvlab-tiny-*.json``,
their ``eval``) and the quality table of ``docs/measurements.md``, shipped as data in
``kvlab/data/quality_table.json`` (``quality_table_from_measurements`` builds it from that file; a test keeps them
equal). Imports no torch unless ``--measure`` runs the machine's own sweep.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from functools import cache
from importlib import resources
from pathlib import Path

from kvlab.roofline import (
    Prediction,
    SpeculativePrediction,
    Target,
    acceptance_from_rate,
    best_speculation_k,
    crossover_context,
    draft_step,
    gb_text,
    kv_bytes_per_step,
    predict,
    predict_json,
    speculate,
    verify_bytes_per_step,
    weight_bytes,
)
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import (
    draft_of,
    draft_presets,
    get_model,
    model_presets,
    same_vocabulary,
    served_context,
    tokenizer_of,
)
from kvlab.spec.published import published_speculative

DEFAULT_CONTEXT = 32 * 1024
PLOT_BATCHES = (1, 4, 16, 64)  # beside the team's own batch
KV_CODECS = ("fp8", "int8", "int4")
KV_GROUP_SIZE = 32  # kvlab's QuantizedKVCache default, the grouping the quality table measured
STREAMING_SINKS, STREAMING_WINDOW = 4, 1020  # StreamingLLM's setting (Xiao et al., arXiv 2309.17453, Table 1)
SHARED_PREFIX_TOKENS = 2048  # an assumed system prompt + tool definitions shared by every sequence in the batch
SESSION_CAP_TOKENS = 8192  # an assumed cap on a chat's context, oldest turns dropped first
SPECULATIVE_ROW = 0  # published_speculative()'s vLLM MATH-500 row: Llama-3-architecture 70B target, 8B draft
# the presets with the shapes of that row's target (DeepSeek-R1-Distill-Llama-70B) and draft (-8B)
SPECULATIVE_PAIR = ("llama-3.1-70b", "llama-3.1-8b")
# DeepSeek-V3's multi-token-prediction module drafts one token; its technical report (arXiv 2412.19437, section
# 5.4.3) measured that token accepted 85% to 90% of the time. The low end is assumed.
MTP_ACCEPTANCE, MTP_K = 0.85, 1
QUALITY_JSON = "quality_table.json"
CHECKPOINT = "kvlab-tiny-stdlib"  # the checkpoint the quality table measured
LESSONS = {
    "04": "lessons/04_batching",
    "05": "lessons/05_prefix_caching",
    "06": "lessons/06_gqa_mqa_mla",
    "07": "lessons/07_window_sinks",
    "08": "lessons/08_heavy_hitters",
    "09": "lessons/09_kv_quantization",
    "10": "lessons/10_speculative_decoding",
}


# -- the course's measured quality ---------------------------------------------------------------------------------
def quality_table_from_measurements(text: str) -> dict:
    """The first table that ``benchmarks/quality_table.py`` printed into ``docs/measurements.md`` (its ``text``).

    Returns ``{"source", "header", "rows"}``; each row: policy, context, ppl, bits_per_token, recall per depth,
    recall_mean, answer_prob_mean, as printed (the time column is left out: it says nothing about quality).
    """
    section = text.split("## `python benchmarks/quality_table.py`", 1)[1]
    block = section.split("```", 2)[1].strip().splitlines()
    header, columns, body = block[0], block[1].split(), block[2:]
    depths = [float(c.removeprefix("recall@")) for c in columns if c.startswith("recall@")]
    rows = []
    for line in body:
        cells = line.split()
        recalls = cells[4 : 4 + len(depths)]
        rows.append(
            {
                "policy": cells[0],
                "context": int(cells[1]),
                "ppl": float(cells[2]),
                "bits_per_token": float(cells[3]),
                "recall": {f"{d:g}": float(r) for d, r in zip(depths, recalls, strict=True)},
                "recall_mean": float(cells[4 + len(depths)]),
                "answer_prob_mean": float(cells[5 + len(depths)]),
            }
        )
    source = "docs/measurements.md, section `python benchmarks/quality_table.py`, first table"
    return {"source": source, "header": header, "rows": rows}


@cache
def quality_table() -> dict:
    """``kvlab/data/quality_table.json``: ``quality_table_from_measurements(docs/measurements.md)``."""
    return json.loads(resources.files("kvlab.data").joinpath(QUALITY_JSON).read_text())


@cache
def checkpoint_record(name: str = CHECKPOINT) -> dict:
    """A shipped checkpoint's record: its ``training`` settings and its ``eval`` (perplexity, passkey recall, the
    sink study)."""
    return json.loads(resources.files("kvlab.data").joinpath(f"{name}.json").read_text())


def trained_length() -> int:
    """The checkpoint's training length: quality is compared there, where the full cache is sound, and at twice it."""
    return checkpoint_record()["training"]["seq_len"]


def _quality_row(policy: str, context: int | None = None) -> dict:
    context = context or trained_length()
    return next(r for r in quality_table()["rows"] if r["policy"] == policy and r["context"] == context)


def _measured(policy: str, context: int | None = None) -> str:
    """``policy``'s perplexity and passkey recall beside the full cache's at ``context``, from the quality table."""
    full, row = _quality_row("full", context), _quality_row(policy, context)
    return (
        f"perplexity {full['ppl']:.3f} -> {row['ppl']:.3f}, passkey recall {full['recall_mean']:.2f} -> "
        f"{row['recall_mean']:.2f}"
    )


def _citation(policy: str) -> str:
    n = trained_length()
    return f"{quality_table()['source']}, row {policy} at {n} tokens ({CHECKPOINT}, trained at {n})"


# -- the report's figures ------------------------------------------------------------------------------------------
def _run(target: Target, context: int, batch: int, **options) -> Prediction:
    """``kvlab predict`` for the team's model and hardware: the figures ``predict --json`` gives for the same flags."""
    return predict(target.cfg, context, target.bandwidth_gbps, batch, hardware_class=target.hardware_class, **options)


def _contexts(max_seq_len: int, context: int, n: int = 48) -> list[int]:
    """``n`` contexts spaced evenly from 256 tokens (or fewer) to the model's max, and the team's own."""
    lo = min(256, max_seq_len)
    grid = {round(lo + (max_seq_len - lo) * i / (n - 1)) for i in range(n)}
    return sorted(grid | {context})


def _breakdown(target: Target, p: Prediction) -> dict:
    """What a step reads, and why: the notes say which parts of the shape shrink which term."""
    cfg = target.cfg
    notes = [f"attention {cfg.attention_kind}: lesson 06 ({LESSONS['06']}) shows what the KV layout saves"]
    if cfg.mla is not None:
        notes.append(
            f"MLA caches one {cfg.mla.cached_elements_per_layer}-element latent per token per layer, "
            "not K and V per head"
        )
    else:
        notes.append(
            f"{cfg.n_kv_heads} KV heads of {cfg.n_heads} query heads, head dim {cfg.head_dim}: "
            f"KV per token = 2 x {cfg.n_layers} layers x {cfg.n_kv_heads} x {cfg.head_dim} x bytes"
        )
    if cfg.moe is not None:
        m = cfg.moe
        notes.append(
            f"mixture of experts: {m.top_k} of {m.n_experts} routed experts per token"
            + (f" + {m.n_shared_experts} shared" if m.n_shared_experts else "")
            + f"; at batch {p.batch} a step reads {p.experts_read:,.1f} distinct experts per MoE layer "
            "(uniform routing: an upper end)"
        )
    served = served_context(cfg.name)
    if served is not None:
        notes.append(
            f"{cfg.name}'s makers document a served context of {served:,} tokens; its config allows "
            f"{cfg.max_seq_len:,} (kvlab/data/reference_presets.md)"
        )
    windows = [w for w in cfg.layer_windows or () if w is not None]
    if windows:
        notes.append(
            f"{len(windows)} of {cfg.n_layers} layers are local (window {max(windows):,} tokens) and read at most "
            "their window; the others read the whole context"
        )
    return {
        "attention": cfg.attention_kind,
        "weight_bytes": p.weight_bytes,
        "weight_bytes_read": p.weight_bytes_read,
        "active_params": p.active_params,
        "experts_read": p.experts_read,
        "weight_dtypes": p.weight_dtypes,
        "kv_dtype": p.kv_dtype,
        "kv_bytes_per_token": p.kv_bytes_per_token,
        "kv_bytes": p.kv_bytes,
        "bytes_per_step": p.bytes_per_step,
        "notes": notes,
    }


def _curves(target: Target, context: int, batch: int) -> list[dict]:
    """TPOT (ms) and the published real-system range against context, for batch 1, a few batches and the team's."""
    cfg = target.cfg
    contexts = _contexts(cfg.max_seq_len, context)
    out = []
    for b in sorted({*PLOT_BATCHES, batch}):
        preds = [_run(target, c, b) for c in contexts]
        out.append(
            {
                "batch": b,
                "context": contexts,
                "tpot_ms": [q.tpot_ms for q in preds],
                "tpot_ms_range": [list(q.tpot_ms_range) for q in preds],
                "memory_needed_bytes": [q.weight_bytes + q.kv_bytes for q in preds],
            }
        )
    return out


def _largest(fits, hi: int) -> int:
    """The largest ``n`` in ``0 .. hi`` with ``fits(n)``, for a ``fits`` true up to some point and false after."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _memory(target: Target, p: Prediction, memory_gb: float | None, context: int, batch: int) -> dict | None:
    """The largest batch at the team's context, and the longest context at their batch, whose KV fits beside the
    weights in ``memory_gb`` (None: the GPU preset's; neither: not judged). KV per sequence is what ``predict``
    counts at batch 1 (local layers keep only their window)."""
    source = "--memory-gb"
    if memory_gb is None and target.gpu is not None:
        memory_gb, source = target.gpu.memory_gb, f"{target.gpu.name} datasheet"
    if memory_gb is None:
        return None
    cfg = target.cfg
    capacity = round(memory_gb * 1e9)
    free = capacity - p.weight_bytes

    def per_sequence(c: int) -> int:
        return kv_bytes_per_step(cfg, c, 1, p.kv_dtype) if c > 0 else 0

    contexts = _contexts(cfg.max_seq_len, context)
    return {
        "memory_bytes": capacity,
        "memory_source": source,
        "weight_bytes": p.weight_bytes,
        "free_for_kv_bytes": free,
        "kv_bytes_per_sequence": per_sequence(context),
        "fits": p.weight_bytes + p.kv_bytes <= capacity,
        # devices of this memory that would hold weights + KV, pooled (tensor parallelism splits both)
        "devices_needed": math.ceil((p.weight_bytes + p.kv_bytes) / capacity),
        "max_batch_at_context": max(0, free // per_sequence(context)),
        "max_context_at_batch": _largest(lambda c: batch * per_sequence(c) <= free, cfg.max_seq_len),
        "curve": {"context": contexts, "max_batch": [max(0, free // per_sequence(c)) for c in contexts]},
        "caveat": "an upper end: activations, the runtime's reserve and paged-block rounding "
        f"(lesson 04, {LESSONS['04']}) come out of the same memory",
    }


def _crossover(target: Target, p: Prediction, batch: int) -> list[dict]:
    """Where a step's KV bytes equal its weight bytes, at batch 1 and the team's batch.

    Without local layers KV grows linearly, so ``crossover_context`` answers; with them the KV a step reads bends
    at each window, so the context is found on ``kv_bytes_per_step`` itself (``None``: not within max context).
    """
    cfg = target.cfg
    local = any(w is not None for w in cfg.layer_windows or ())
    out = []
    for b in sorted({1, batch}):
        weights = _run(target, 1, b).weight_bytes_read
        if local:
            below = _largest(lambda c, b=b, w=weights: kv_bytes_per_step(cfg, c, b, p.kv_dtype) < w, cfg.max_seq_len)
            tokens: float | None = below + 1 if below < cfg.max_seq_len else None
            method = "kv_bytes_per_step (local layers read at most their window)"
        else:
            tokens = crossover_context(weights, p.kv_bytes_per_token, b)
            method = "crossover_context"
        reached = tokens is not None and tokens <= cfg.max_seq_len
        out.append({"batch": b, "weight_bytes_read": weights, "context": tokens, "within_max": reached, "by": method})
    return out


def _speculative_assumption(cfg: ModelConfig) -> dict:
    """The draft the report assumes for ``cfg``, and the acceptance it drafts at, with their sources.

    A draft must share the target's vocabulary (``kvlab.spec.presets.same_vocabulary``), so, in order:

    1. ``"preset"``: the smallest preset of the target's own tokenizer (both named in the reference table), smaller
       than the target, at
       the acceptance of the cited published row (a 70B/8B pair of one family);
    2. ``"head"``: the draft head the target ships (a preset whose ``draft_of`` is the target: DeepSeek-V3's
       multi-token-prediction module), at its own published acceptance;
    3. ``"fraction"``: an assumed draft of the target's vocabulary reading the share of the target's bytes that the
       cited row's draft reads of its target's, at that row's acceptance.
    """
    row = published_speculative()[SPECULATIVE_ROW]
    a = acceptance_from_rate(row.acceptance_rate, row.k)
    cited = (
        f"kvlab/data/published_speculative.csv row {SPECULATIVE_ROW + 1}: {row.source}; {row.target} drafted by "
        f"{row.draft} on {row.task}, {row.acceptance_rate:.4f} of drafts accepted at k = {row.k}, which "
        f"acceptance_from_rate turns into a per-draft acceptance a = {a:.3f}"
    )
    # a preset drafts only for a target whose tokenizer is known to be its own: one vocabulary size is not enough
    # (Llama-2 and Mistral both have 32,000 tokens), so a --config target gets the assumed draft
    family_name = tokenizer_of(cfg.name)
    usable = [
        d
        for d in (*model_presets().values(), *draft_presets().values())
        if d.name != cfg.name
        and family_name is not None
        and tokenizer_of(d.name) == family_name
        and same_vocabulary(cfg, d) is None
    ]
    family = [d for d in usable if draft_of(d.name) is None and weight_bytes(d) < weight_bytes(cfg)]
    heads = [d for d in usable if draft_of(d.name) == cfg.name]
    out = {"row": asdict(row), "acceptance": a, "k_max": 16, "draft": None, "draft_fraction": None}
    if family:
        draft = min(family, key=weight_bytes)
        return out | {
            "kind": "preset",
            "draft": draft.name,
            "why": f"{draft.name} is the smallest preset sharing {cfg.name}'s vocabulary ({cfg.vocab_size:,} tokens)",
            "citation": cited,
        }
    if heads:
        return out | {
            "kind": "head",
            "draft": heads[0].name,
            "row": None,
            "acceptance": MTP_ACCEPTANCE,
            "k_max": MTP_K,
            "why": f"{cfg.name} ships its own draft head ({heads[0].name}, kvlab/data/reference_presets.md) and no "
            "smaller preset shares its vocabulary",
            "citation": "deepseek-ai/DeepSeek-V3 README_WEIGHTS.md (one MTP module: 11.5B parameters besides the "
            "shared embedding and head, 2.4B active); DeepSeek-V3 technical report, arXiv 2412.19437, section "
            f"5.4.3 (the second token accepted 85% to 90% of the time: a = {MTP_ACCEPTANCE} assumed, k = {MTP_K})",
        }
    big, small = (weight_bytes(get_model(name)) for name in SPECULATIVE_PAIR)
    return out | {
        "kind": "fraction",
        "draft_fraction": small / big,
        "why": (
            f"no smaller preset shares {cfg.name}'s tokenizer, and it ships no draft head"
            if family_name is not None
            else f"{cfg.name}'s tokenizer is not one the presets name, so no preset is known to share it"
        )
        + "; the draft is an assumption",
        "citation": f"{cited}; the draft's share of bytes is that pair's, {SPECULATIVE_PAIR[1]} over "
        f"{SPECULATIVE_PAIR[0]} ({small / big:.3f} of the weights)",
    }


def _mitigations(target: Target, p: Prediction, context: int, batch: int) -> list[dict]:
    """Each mitigation's prediction at the team's context and batch, its cost in quality, and its lesson."""
    cfg = target.cfg
    rows: list[dict] = []

    def add(
        key: str,
        name: str,
        lesson: str,
        flags: list[str],
        q: Prediction,
        spec: SpeculativePrediction | None = None,
        extra_memory_bytes: int = 0,
        **text: str,
    ) -> None:
        """One row; ``extra_memory_bytes``: what the mitigation holds beside the target's weights and KV."""
        tpot = spec.tpot_ms if spec is not None else q.tpot_ms
        rows.append(
            {
                "key": key,
                "name": name,
                "lesson": lesson,
                "lesson_path": LESSONS[lesson],
                "predict_flags": flags,
                "prediction": predict_json(cfg, q, spec, target.memory_gb),
                "tpot_ms": tpot,
                "tpot_ms_range": list(q.tpot_ms_range) if spec is None else None,
                "speedup": p.tpot_ms / tpot,
                "memory_needed_bytes": q.weight_bytes + q.kv_bytes + extra_memory_bytes,
                **text,
            }
        )

    for codec in KV_CODECS:
        # fp8 as serving teams run it: vLLM's default cache, one scale per tensor left at 1.0 (1 B/element), with the
        # quality kvlab measured for that codec (fp8-tensor). int8/int4 as kvlab's codecs, a scale per group.
        per_tensor = codec == "fp8"
        group, policy = (None, "fp8-tensor") if per_tensor else (KV_GROUP_SIZE, codec)
        q = _run(target, context, batch, kv_dtype=codec, group_size=group)
        quality = f"measured on the course's checkpoint: {_measured(policy)} (the newest 128 tokens kept exact)"
        if per_tensor:
            quality += (
                ", with one e4m3 scale per tensor left at 1.0, as vLLM stores it without calibration. A model whose "
                "K/V values sit far from the range e4m3 covers at scale 1.0 loses more; vLLM's docs recommend "
                "calibrating the scales, and measuring your own"
            )
        add(
            f"kv-{codec}",
            f"{codec} KV cache" + (" (per-tensor scale, the vLLM default)" if per_tensor else ""),
            "09",
            ["--kv-dtype", codec] + ([] if group is None else ["--group-size", str(group)]),
            q,
            assumption=f"{q.kv_scales}; the attention kernel must read the compressed bytes itself, or the step "
            "gains nothing",
            quality=quality,
            citation=_citation(policy)
            + (
                "; vLLM's fp8 cache: docs/features/quantization/quantized_kvcache.md in vllm-project/vllm"
                if per_tensor
                else ""
            ),
        )

    window = STREAMING_WINDOW
    q = _run(target, context, batch, window=window, sinks=STREAMING_SINKS)
    sinks = checkpoint_record()["eval"]["sinks"]
    sink_ppl = sinks["perplexity"]
    policy, n = "window-256+4sinks/reassigned", trained_length()
    add(
        "window-sinks",
        f"window {window:,} + {STREAMING_SINKS} sinks",
        "07",
        ["--window", str(window), "--sinks", str(STREAMING_SINKS)],
        q,
        assumption=f"StreamingLLM's default: the first {STREAMING_SINKS} tokens and the {window:,} most recent "
        + (
            "(the context is within it, so nothing changes)"
            if context <= window + STREAMING_SINKS
            else "(TPOT stops growing with context)"
        ),
        quality=f"anything older than the window is forgotten: {_measured(policy)} with a 256-token window at "
        f"{n} tokens; past the trained length the window is the sound one: {_measured(policy, 2 * n)} "
        f"at {2 * n} (the record's sink study, {sinks['context']} tokens, window {sinks['window']} + {sinks['sinks']} "
        f"sinks: perplexity {sink_ppl['window+sinks/reassigned']:.3f} against the full cache's {sink_ppl['full']:.3f})",
        citation=f"{_citation(policy)} and at {2 * n}; kvlab/data/{CHECKPOINT}.json eval.sinks",
    )

    prefix = min(SHARED_PREFIX_TOKENS, context)
    q = _run(target, context, batch, shared_prefix=prefix)
    add(
        "shared-prefix",
        f"shared {prefix:,}-token prefix",
        "05",
        ["--shared-prefix", str(prefix)],
        q,
        assumption=f"an assumed {prefix:,}-token system prompt shared by all {batch} sequences, stored once and read "
        "once per step by a shared-prefix (cascade) kernel"
        + ("; at batch 1 it is read once anyway" if batch == 1 else ""),
        quality="none: every sequence attends to the same K/V as before",
        citation="exact by construction; lesson 05 measures the bytes and time a cascade kernel saves "
        "(docs/measurements.md, benchmarks/mitigations.py)",
    )

    cap = min(SESSION_CAP_TOKENS, context)
    q = _run(target, cap, batch)
    add(
        "session-cap",
        f"session cap at {cap:,} tokens",
        "08",
        ["--context", str(cap)],
        q,
        assumption=f"an assumed cap of {SESSION_CAP_TOKENS:,} tokens: the oldest turns are dropped (the system "
        "prompt stays), and each drop re-prefills what is kept, which lesson 08 measures against the bytes saved"
        + ("; the context is within it, so nothing changes" if context <= SESSION_CAP_TOKENS else ""),
        quality="the dropped turns are forgotten; a token not kept is not recalled "
        f"({_measured('window-256')} with a 256-token window; H2O's keep rule drops a passkey too: "
        f"{_measured('h2o-128')} with a 128-token budget)",
        citation=f"{_citation('window-256')}; same table, row h2o-128",
    )

    spec = _speculative_assumption(cfg)
    draft = get_model(spec["draft"]) if spec["draft"] else None
    fraction = spec["draft_fraction"]
    if draft is not None:
        d = draft_step(p, draft)
        draft_bytes, draft_memory = d.bytes_per_step, d.weight_bytes + d.kv_bytes
        drafter = (
            f"{draft.name} drafts, reading {gb_text(draft_bytes)} a step; its weights and KV are counted in memory"
        )
        if spec["kind"] == "head":
            drafter += " (its embedding and head too, though it shares the target's)"
        flags = ["--draft-model", draft.name]
    else:
        draft_bytes = round(fraction * p.bytes_per_step)
        draft_memory = round(fraction * (p.weight_bytes + p.kv_bytes))
        drafter = (
            f"a draft reading {fraction:.1%} of the target's bytes a step ({gb_text(draft_bytes)}), and holding that "
            "share of its weights and KV in memory"
        )
        flags = ["--draft-fraction", repr(fraction)]
    k = best_speculation_k(
        p.bytes_per_step, spec["acceptance"], draft_bytes, spec["k_max"], lambda k: verify_bytes_per_step(cfg, p, k)
    )
    result = speculate(cfg, p, k, spec["acceptance"], draft, fraction)
    add(
        "speculative",
        f"speculative decoding, k = {k}" if k else "speculative decoding (k = 0: this draft does not pay)",
        "10",
        ["--speculate", str(k), "--acceptance", repr(spec["acceptance"]), *flags],
        p,
        result,
        extra_memory_bytes=draft_memory if k else 0,  # k = 0: no draft is loaded
        assumption=f"{drafter} ({spec['why']}); per-draft acceptance a = {spec['acceptance']:.3f}, the cited "
        "figure (yours depends on your draft, target and traffic); k chosen "
        "for the fewest bytes per token; the verify step reads the weights its k + 1 positions per sequence use"
        + (" (a mixture of experts: more experts than a plain step)" if cfg.moe is not None else "")
        + "; assumes the verify step stays bandwidth-bound, which it does at batch 1 and less so as the batch grows",
        quality="none: speculative sampling keeps the target's output distribution exactly (Leviathan et al., "
        "arXiv 2211.17192; Chen et al., arXiv 2302.01318); the acceptance, and so the speedup, depends on the task",
        citation=spec["citation"],
    )
    return rows


def build_report(target: Target, context: int, batch: int, memory_gb: float | None = None, sweep=None) -> dict:
    """Every figure of the report, as JSON-ready data. ``memory_gb``: the memory to fit into (None: the GPU
    preset's, if any); ``sweep``: a ``kvlab.measure.sweep.Sweep`` measured on this machine, or None."""
    cfg = target.cfg
    p = _run(target, context, batch)
    return {
        "inputs": {
            "model": cfg.name,
            "gpu": target.gpu.name if target.gpu else None,
            "bandwidth_gbps": target.bandwidth_gbps,
            "bandwidth_source": target.bandwidth_source,
            "memory_gb": memory_gb,
            "context": context,
            "batch": batch,
            "max_seq_len": cfg.max_seq_len,
        },
        "prediction": predict_json(cfg, p, None, target.memory_gb),
        "breakdown": _breakdown(target, p),
        "curves": _curves(target, context, batch),
        "memory": _memory(target, p, memory_gb, context, batch),
        "crossover": _crossover(target, p, batch),
        "speculative_assumption": _speculative_assumption(cfg),
        "mitigations": _mitigations(target, p, context, batch),
        "measured": None if sweep is None else sweep.to_dict(),
    }


# -- rendering -----------------------------------------------------------------------------------------------------
def write_quality_table(measurements: str | Path = "docs/measurements.md") -> Path:
    """Rebuild ``kvlab/data/quality_table.json`` from ``docs/measurements.md`` after the table there changes."""
    path = Path(str(resources.files("kvlab.data").joinpath(QUALITY_JSON)))
    table = quality_table_from_measurements(Path(measurements).read_text())
    path.write_text(json.dumps(table, indent=2) + "\n")
    return path
