"""The bytes-per-step model of decoding, and the FLOPs beside it: arithmetic only, with no torch import.

A decode step streams every weight it uses once and, for each sequence in the batch, every cached K/V byte once:

    TPOT ~= (weight bytes read + batch * KV bytes per sequence) / memory bandwidth

Two figures for the weights, on purpose:
- ``weight_bytes``: all parameters times their size. This is what a checkpoint weighs and what memory must hold.
- ``weight_bytes_read``: what one step reads. A mixture-of-experts step reads the dense weights plus only the
  experts its batch routes to (``active_params``): at batch 1 the ``top_k`` routed experts per MoE layer, and more
  distinct experts as the batch grows, up to all of them. An untied input embedding is a lookup table: a step reads
  one row per sequence, not the whole matrix (``input_embedding="rows"``). The course's worked examples and most
  published estimates charge the whole table (``"table"``), which is ``predict``'s default; for a dense model that
  makes ``weight_bytes_read`` equal ``weight_bytes``. A tied embedding is read in full anyway, as the output head.

Each part of a checkpoint is counted in the dtype it ships in (``ModelConfig.weight_dtypes``: DeepSeek-V3's FP8,
gpt-oss's MXFP4 experts), and quantized weights count their group scales (``weight_element_bytes``). The sources of
every model fact are in ``kvlab/data/reference_presets.md``.

The ceilings these counts are judged against are measured by ``kvlab.machine.timing`` (bandwidth, matmul FLOP/s), or come
from datasheets (``kvlab.spec.presets``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache

from kvlab.spec.config import WEIGHT_COMPONENTS, ModelConfig
from kvlab.spec.dtypes import BYTES_PER_ELEMENT, GROUP_STAT_BYTES, KV_DTYPES, KV_GROUP_STATS, canonical_dtype
from kvlab.spec.published import QUANTIZED_BYTES_PER_PARAM, FractionRange, matching_fraction_range
from kvlab.spec.validation import require_fraction, require_int

INPUT_EMBEDDING_CONVENTIONS = ("table", "rows")
# A quantized int weight group stores one 16-bit scale and one 16-bit zero point beside its payload.
WEIGHT_GROUP_OVERHEAD_BYTES = 4


# -- parameter and byte counts ------------------------------------------------------------------------------------
def param_count(cfg: ModelConfig) -> int:
    """All parameters: the published count where the config carries one, else counted from the shape.

    The shape count covers embeddings (twice when untied), attention (or MLA), each layer's MLP (dense, or MoE:
    router, routed and shared experts), the norms. It leaves out biases and per-head norms, which some models have
    (gpt-oss, Qwen); ``kvlab/data/reference_presets.md`` says how close each preset comes to its published count.
    """
    if cfg.n_params is not None:
        return cfg.n_params
    per_layer = _attention_params(cfg) + 2 * cfg.d_model
    return (
        _embedding_params(cfg) * (1 if cfg.tie_embeddings else 2)
        + cfg.n_layers * per_layer
        + _mlp_params(cfg)
        + (cfg.d_model)
    )


def _embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.d_model


def _attention_params(cfg: ModelConfig) -> int:
    d, h = cfg.d_model, cfg.n_heads
    if cfg.mla is None:
        return 2 * d * h * cfg.head_dim + 2 * d * cfg.n_kv_heads * cfg.head_dim
    m = cfg.mla
    qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = d * h * qk_dim if m.q_lora_rank is None else d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk_dim
    kv = (
        d * (m.kv_lora_rank + m.qk_rope_head_dim)
        + m.kv_lora_rank
        + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    )
    return q + kv + h * m.v_head_dim * d


def _expert_params(cfg: ModelConfig) -> int:
    """One expert's SwiGLU weights (gate, up, down)."""
    return 3 * cfg.d_model * cfg.moe.expert_d_ff


def _moe_layers(cfg: ModelConfig) -> int:
    return cfg.n_layers - cfg.moe.n_dense_layers


def _mlp_params(cfg: ModelConfig) -> int:
    """Every layer's MLP: dense SwiGLU, or for MoE layers the router and all experts."""
    dense = 3 * cfg.d_model * cfg.d_ff
    if cfg.moe is None:
        return cfg.n_layers * dense
    m = cfg.moe
    moe_layer = cfg.d_model * m.n_experts + (m.n_experts + m.n_shared_experts) * _expert_params(cfg)
    return m.n_dense_layers * dense + _moe_layers(cfg) * moe_layer


def expected_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of ``batch`` tokens routes to in one MoE layer, in expectation.

    Each token picks ``top_k`` of ``n_experts``; under uniform routing one token misses a given expert with
    probability ``1 - top_k / n_experts``, so the expected number hit is ``E * (1 - (1 - k/E)^batch)``: ``top_k`` at
    batch 1, approaching ``n_experts`` as the batch grows. Real routers favour some experts, and skewed routing hits
    fewer distinct experts, so uniform is the upper end for a given batch.
    """
    require_int("batch", batch)
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def _check_convention(input_embedding: str) -> None:
    if input_embedding not in INPUT_EMBEDDING_CONVENTIONS:
        raise ValueError(
            f"input_embedding: {input_embedding!r}; allowed: {', '.join(INPUT_EMBEDDING_CONVENTIONS)} "
            "(charge the whole untied input table, or one row per sequence)"
        )


def _params_read(cfg: ModelConfig, batch: int | None, input_embedding: str) -> dict[str, float]:
    """Parameters per component (``WEIGHT_COMPONENTS``) that one step at ``batch`` reads; ``None``: all of them."""
    _check_convention(input_embedding)
    table = _embedding_params(cfg)
    embeddings = table
    if not cfg.tie_embeddings:
        rows = table if batch is None or input_embedding == "table" else min(batch, cfg.vocab_size) * cfg.d_model
        embeddings = table + rows
    all_experts = experts = 0.0
    if cfg.moe is not None:
        m = cfg.moe
        per_expert = _moe_layers(cfg) * _expert_params(cfg)
        all_experts = (m.n_experts + m.n_shared_experts) * per_expert
        routed = m.n_experts if batch is None else expected_experts(m.n_experts, m.top_k, batch)
        experts = (routed + m.n_shared_experts) * per_expert
    other = param_count(cfg) - table * (1 if cfg.tie_embeddings else 2) - all_experts
    if other < 0:
        raise ValueError(
            f"n_params: {param_count(cfg):,} is fewer than the embeddings and experts of the shape "
            f"({param_count(cfg) - other:,.0f}); allowed: a count that includes them"
        )
    return {"embeddings": embeddings, "experts": experts, "other": other}


def active_params(cfg: ModelConfig, batch: int = 1, input_embedding: str = "table") -> int:
    """Distinct parameters one decode step over ``batch`` sequences reads (expected value, rounded).

    Dense model: every parameter (``param_count``). Mixture of experts: the dense parts, the shared experts, and per
    MoE layer the ``expected_experts`` its batch routes to, so ``top_k`` experts at batch 1 (the model's "active
    parameters") rising toward ``param_count`` as the batch grows.

    ``input_embedding``: ``"table"`` (default) counts an untied input embedding whole, as Mixtral's published 12.9B
    active and DeepSeek-V3's 36.7B (its README_WEIGHTS.md: embedding and head included) do; ``"rows"`` counts the
    one row per sequence a step looks up, as gpt-oss's (3.6B, 5.1B) published active counts do.

    For FLOPs, use ``batch=1``: each token multiplies by its own ``top_k`` experts only, so a step's matmul FLOPs are
    about ``2 x active_params(cfg, 1) x batch`` (minus the input lookup, which does no multiply), while the bytes it
    reads are ``active_params(cfg, batch)`` times their size.
    """
    require_int("batch", batch)
    return round(sum(_params_read(cfg, batch, input_embedding).values()))


def resolve_weight_dtypes(cfg: ModelConfig, weight_dtype: str | None = None) -> dict[str, str]:
    """The dtype of each weight component: ``weight_dtype`` for all of them when given, else what the checkpoint
    ships (``cfg.weight_dtypes``), else ``cfg.dtype``. Only components the model has are listed."""
    if weight_dtype is not None:
        every = canonical_dtype(weight_dtype, "weight_dtype")
        shipped = dict.fromkeys(WEIGHT_COMPONENTS, every)
    else:
        shipped = {c: dict(cfg.weight_dtypes or ()).get(c, cfg.dtype) for c in WEIGHT_COMPONENTS}
    present = _params_read(cfg, None, "table")
    return {c: dtype for c, dtype in shipped.items() if present[c] > 0}


def weight_element_bytes(weight_dtype: str, group_size: int | None = None) -> float:
    """Bytes per weight, scales included.

    ``group_size``: int8 and int4 weights quantized in groups of that many store one 16-bit scale and one 16-bit
    zero point per group (``WEIGHT_GROUP_OVERHEAD_BYTES``), so int4 is 0.5 + 4/g bytes and int8 1 + 4/g. That
    reproduces the published bytes per weight: torchao int4 g64 and gpt-fast int4 g32 (0.5625 and 0.625); llama.cpp
    Q4_0 and MLC q4f16_1 spend the same 0.5625 (a 16-bit scale per 32 weights: pass int4 g64) and Q8_0 1.0625 (int8
    g64). Without ``group_size`` the payload alone is counted, which is right for int8 with one scale per output
    channel (gpt-fast's and torchao's int8: the scales add under 0.1%). ``mxfp4`` includes its own scales (4.25
    bits); float dtypes take no group size.
    """
    dtype = canonical_dtype(weight_dtype, "weight_dtype")
    size = BYTES_PER_ELEMENT[dtype]
    if group_size is None:
        return size
    require_int("weight_group_size", group_size)
    if dtype not in ("int8", "int4"):
        raise ValueError(
            f"weight_group_size: {group_size} with {dtype} weights; allowed: only int8 or int4 weights carry group "
            "scales (mxfp4 counts its own; give --weight-dtype int4 or int8 with it)"
        )
    return size + WEIGHT_GROUP_OVERHEAD_BYTES / group_size


def _weight_bytes(
    cfg: ModelConfig, weight_dtype: str | None, batch: int | None, group_size: int | None, input_embedding: str
) -> int:
    dtypes = resolve_weight_dtypes(cfg, weight_dtype)
    params = _params_read(cfg, batch, input_embedding)
    return round(sum(params[c] * weight_element_bytes(dtype, group_size) for c, dtype in dtypes.items()))


def weight_bytes(cfg: ModelConfig, weight_dtype: str | None = None, group_size: int | None = None) -> int:
    """Bytes of all parameters, each component in its dtype (see ``resolve_weight_dtypes``), scales included."""
    return _weight_bytes(cfg, weight_dtype, None, group_size, "table")


def weight_bytes_read(
    cfg: ModelConfig,
    weight_dtype: str | None = None,
    batch: int = 1,
    group_size: int | None = None,
    input_embedding: str = "rows",
) -> int:
    """Bytes of weights one decode step over ``batch`` sequences reads: ``active_params`` in their dtypes.

    Defaults to what a step really reads (``input_embedding="rows"``: one row of an untied input table per
    sequence); ``predict`` charges the whole table by default, as the course's worked example does.
    """
    require_int("batch", batch)
    return _weight_bytes(cfg, weight_dtype, batch, group_size, input_embedding)


def kv_elements_per_token_per_layer(cfg: ModelConfig) -> int:
    """Elements one token caches in one layer: K and V for each KV head, or MLA's one latent."""
    if cfg.mla is not None:
        return cfg.mla.cached_elements_per_layer
    return 2 * cfg.n_kv_heads * cfg.head_dim


def kv_element_bytes(kv_dtype: str, group_size: int | None = None) -> float:
    """Bytes per cached element: the payload, plus, with ``group_size``, the scale (and zero point) that each group
    of that many elements shares, as kvlab's codecs store them (KIVI grouping: keys per channel, values per token,
    one set of fp16 statistics per ``group_size`` elements either way; ``KV_GROUP_STATS``). A full-precision
    residual window is not counted.
    """
    key = canonical_dtype(kv_dtype, "kv_dtype", KV_DTYPES)
    size = BYTES_PER_ELEMENT[key]
    if group_size is None:
        return size
    require_int("group_size", group_size)
    payload = math.ceil(group_size * size)  # int4 packs two codes a byte: an odd group's last byte is half used
    return (payload + KV_GROUP_STATS.get(key, 0) * GROUP_STAT_BYTES) / group_size


def kv_scales(kv_dtype: str, group_size: int | None = None) -> str | None:
    """What the byte count assumes about a quantized cache's scales, in words (``None`` for a float16/32 cache).

    Without ``group_size`` only the payload is counted: one scale per tensor, which is how vLLM's default fp8 cache
    stores it (1 B/element; its scales are 1.0 unless calibrated). With ``group_size``, kvlab's codecs: one fp16
    scale per group (fp8), or a scale and a zero point (int8, int4).
    """
    key = canonical_dtype(kv_dtype, "kv_dtype", KV_DTYPES)
    stats = KV_GROUP_STATS.get(key)
    if stats is None:
        return None
    if group_size is None:
        return f"one scale per tensor, {BYTES_PER_ELEMENT[key]:g} B/element" + (
            ", as vLLM's default fp8 cache stores it" if key == "fp8" else ""
        )
    kept = "a 16-bit scale" if stats == 1 else "a 16-bit scale and zero point"
    return f"{kept} per group of {group_size}, {kv_element_bytes(key, group_size):g} B/element, as kvlab's codec"


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str | None = None, group_size: int | None = None) -> int:
    """Bytes one token of one sequence caches across all layers: 2 x layers x KV heads x head dim x bytes."""
    size = kv_element_bytes(kv_dtype or cfg.dtype, group_size)
    return round(cfg.n_layers * kv_elements_per_token_per_layer(cfg) * size)


@dataclass(frozen=True)
class TokensRead:
    """Token-layers one decode step reads: ``shared`` once for the whole batch, ``per_sequence`` for each sequence."""

    shared: int
    per_sequence: int


def kv_tokens_read(
    cfg: ModelConfig, context: int, window: int | None = None, sinks: int = 0, shared_prefix: int = 0
) -> TokensRead:
    """Which cached tokens each layer reads at ``context`` tokens, summed over layers.

    - A local layer of the model (``cfg.layer_windows``) reads at most its own window.
    - A ``window`` + ``sinks`` policy keeps the first ``sinks`` tokens and the ``window`` most recent ones.
    - The first ``shared_prefix`` tokens are shared by every sequence in the batch; a shared-prefix (cascade)
      kernel reads the ones a layer keeps once per step, not once per sequence.
    """
    require_int("context", context, 0)
    if window is not None:
        require_int("window", window)
    require_int("sinks", sinks, 0)
    require_int("shared_prefix", shared_prefix, 0)
    if sinks and window is None:
        raise ValueError("sinks: only meaningful with a window; allowed: give window too, or sinks=0")
    if shared_prefix > context:
        raise ValueError(f"shared_prefix: {shared_prefix}; allowed: at most the context ({context})")
    shared = per_sequence = 0
    for layer_window, n_layers in _layers_by_window(cfg):
        for start, end in _kept_intervals(context, layer_window, window, sinks):
            in_prefix = max(0, min(end, shared_prefix) - start)
            shared += n_layers * in_prefix
            per_sequence += n_layers * (end - start - in_prefix)
    return TokensRead(shared, per_sequence)


@lru_cache(maxsize=64)
def _layers_by_window(cfg: ModelConfig) -> tuple[tuple[int | None, int], ...]:
    """``(window, n_layers)`` per distinct layer window: layers with the same window read the same tokens, so
    ``kv_tokens_read`` makes one pass per window (a simulated clock asks it for every row of every step)."""
    return tuple(Counter(cfg.layer_windows or (None,) * cfg.n_layers).items())


def _kept_intervals(context: int, layer_window: int | None, window: int | None, sinks: int) -> list[tuple[int, int]]:
    """Half-open position ranges one layer keeps: sinks and recent window, clipped to the layer's own window."""
    if window is None:
        kept = [(0, context)]
    else:
        head = min(sinks, context)
        kept = [(0, head), (max(head, context - window), context)]
    if layer_window is not None:
        kept = [(max(start, context - layer_window), end) for start, end in kept]
    return [(start, end) for start, end in kept if end > start]


def kv_bytes_per_step(
    cfg: ModelConfig,
    context: int,
    batch: int = 1,
    kv_dtype: str | None = None,
    window: int | None = None,
    sinks: int = 0,
    shared_prefix: int = 0,
    group_size: int | None = None,
) -> int:
    """KV bytes one decode step reads for the whole batch, each sequence attending over ``context`` tokens.

    Honours the model's local layers, a ``window`` + ``sinks`` policy, and a ``shared_prefix`` read once per batch
    (see ``kv_tokens_read``).
    """
    require_int("batch", batch)
    size = kv_element_bytes(kv_dtype or cfg.dtype, group_size)
    tokens = kv_tokens_read(cfg, context, window, sinks, shared_prefix)
    return round((tokens.shared + batch * tokens.per_sequence) * kv_elements_per_token_per_layer(cfg) * size)


def bytes_per_step(
    cfg: ModelConfig, context: int, batch: int = 1, weight_dtype: str | None = None, kv_dtype: str | None = None
) -> int:
    """Weight bytes (all parameters) plus the KV bytes the step reads for the whole batch."""
    return weight_bytes(cfg, weight_dtype) + kv_bytes_per_step(cfg, context, batch, kv_dtype)


def predict_tpot_ms(n_bytes: float, bandwidth_gbps: float) -> float:
    """Lower bound on time per output token: bytes streamed / bandwidth (GB/s = 1e9 bytes/s), in ms."""
    if not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth: {bandwidth_gbps!r}; allowed: a number of GB/s > 0")
    return n_bytes / (bandwidth_gbps * 1e9) * 1e3


def published_tpot_range(
    tpot_ms: float, hardware_class: str | None = None, batch: int = 1, quantized: bool = False
) -> tuple[tuple[float, float], FractionRange]:
    """The TPOT real systems like the target reach for a bandwidth-bound ``tpot_ms``, and the rows that say so.

    Published decode measurements of the same hardware class, regime and weight format (``matching_fraction_range``,
    which falls back in a stated order) achieved between ``lo`` and ``hi`` of nominal bandwidth, so a real step
    takes ``tpot_ms / hi`` to ``tpot_ms / lo``. ``tpot_ms`` must count bytes the way the published file does (an
    untied input table as one row per sequence), or the fractions do not apply to it.
    """
    fractions = matching_fraction_range(hardware_class, batch, quantized)
    return (tpot_ms / fractions.hi, tpot_ms / fractions.lo), fractions


@dataclass(frozen=True)
class Prediction:
    """One decode step's bytes and predicted TPOT. Bytes are exact integers; GB means 1e9 bytes.

    - ``weight_dtypes``: the dtype of each weight component (``kvlab.spec.config.WEIGHT_COMPONENTS``) the model has;
      ``weight_dtype`` is their one dtype, or ``"mixed"`` when they differ.
    - ``weight_bytes``: all parameters; ``weight_bytes_read``: what the step reads (``active_params`` of them, under
      the ``input_embedding`` convention). ``bytes_per_step`` and ``tpot_ms`` use the bytes read.
    - ``kv_scales``: for a quantized cache, which scales the bytes include (``kv_scales``); ``None`` otherwise.
    - ``experts_read``: expected distinct routed experts per MoE layer at this batch (``None`` for a dense model).
    - ``tpot_ms_range``: what real systems like this one reach, from published measurements: the rows of the same
      ``hardware_class`` (``kvlab.spec.published.HARDWARE_CLASSES``; ``None``: not known), regime (batch 1 or batched)
      and weight format (16-bit or quantized), falling back in ``matching_fraction_range``'s order when too few
      match. ``tpot_ms_range_basis`` says which rows and which set each end; ``tpot_ms_range_fractions`` are the
      (lowest, highest) bandwidth fractions; ``tpot_ms_range_rows`` names the match and the two end rows. The
      fractions were measured against bytes counted the published file's way (an untied input table as one row per
      sequence), so they divide the TPOT of the bytes counted that way, whatever ``input_embedding`` says.
    """

    model: str
    context: int
    batch: int
    weight_dtype: str
    weight_dtypes: dict[str, str]
    weight_group_size: int | None
    input_embedding: str
    kv_dtype: str
    kv_scales: str | None
    window: int | None
    sinks: int
    shared_prefix: int
    group_size: int | None
    bandwidth_gbps: float
    weight_bytes: int
    active_params: int
    experts_read: float | None
    weight_bytes_read: int
    kv_bytes_per_token: int
    kv_bytes: int
    bytes_per_step: int
    tpot_ms: float
    tpot_ms_weights_only: float
    tpot_ms_range: tuple[float, float]
    tpot_ms_range_basis: str
    hardware_class: str | None
    tpot_ms_range_fractions: tuple[float, float]
    tpot_ms_range_rows: dict

    def to_dict(self) -> dict:
        return asdict(self)


def predict(
    cfg: ModelConfig,
    context: int,
    bandwidth_gbps: float,
    batch: int = 1,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
    window: int | None = None,
    sinks: int = 0,
    shared_prefix: int = 0,
    group_size: int | None = None,
    weight_group_size: int | None = None,
    input_embedding: str = "table",
    hardware_class: str | None = None,
) -> Prediction:
    """The whole breakdown for one step at ``context`` tokens and ``batch`` sequences (see ``kv_tokens_read``).

    Weights default to the dtypes the checkpoint ships in; ``weight_dtype`` overrides every component, and
    ``weight_group_size`` counts int8/int4 group scales (``weight_element_bytes``). ``group_size`` does the same for
    a quantized KV cache. ``context`` may not exceed the model's ``max_seq_len`` (its ``max_position_embeddings``):
    a model is not served beyond it without RoPE scaling, which a config must then state. ``hardware_class``
    picks the published measurements ``tpot_ms_range`` rests on.
    """
    require_int("context", context)
    if context > cfg.max_seq_len:
        raise ValueError(
            f"context: {context:,} tokens; allowed: at most {cfg.name}'s max_seq_len={cfg.max_seq_len:,} "
            "(its max_position_embeddings)"
        )
    dtypes = resolve_weight_dtypes(cfg, weight_dtype)
    kv_dtype = canonical_dtype(kv_dtype or cfg.dtype, "kv_dtype", KV_DTYPES)
    read = weight_bytes_read(cfg, weight_dtype, batch, weight_group_size, input_embedding)
    kv = kv_bytes_per_step(cfg, context, batch, kv_dtype, window, sinks, shared_prefix, group_size)
    tpot_ms = predict_tpot_ms(read + kv, bandwidth_gbps)
    # the published fractions are against bytes counted the file's way: an untied input table as one row per sequence
    read_as_published = weight_bytes_read(cfg, weight_dtype, batch, weight_group_size, "rows")
    quantized = read_as_published / active_params(cfg, batch, "rows") < QUANTIZED_BYTES_PER_PARAM
    tpot_range, fractions = published_tpot_range(
        predict_tpot_ms(read_as_published + kv, bandwidth_gbps), hardware_class, batch, quantized
    )
    return Prediction(
        model=cfg.name,
        context=context,
        batch=batch,
        weight_dtype=next(iter(dtypes.values())) if len(set(dtypes.values())) == 1 else "mixed",
        weight_dtypes=dtypes,
        weight_group_size=weight_group_size,
        input_embedding=input_embedding,
        kv_dtype=kv_dtype,
        kv_scales=kv_scales(kv_dtype, group_size),
        window=window,
        sinks=sinks,
        shared_prefix=shared_prefix,
        group_size=group_size,
        bandwidth_gbps=bandwidth_gbps,
        weight_bytes=weight_bytes(cfg, weight_dtype, weight_group_size),
        active_params=active_params(cfg, batch, input_embedding),
        experts_read=None if cfg.moe is None else expected_experts(cfg.moe.n_experts, cfg.moe.top_k, batch),
        weight_bytes_read=read,
        kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype, group_size),
        kv_bytes=kv,
        bytes_per_step=read + kv,
        tpot_ms=tpot_ms,
        tpot_ms_weights_only=predict_tpot_ms(read, bandwidth_gbps),
        tpot_ms_range=tpot_range,
        tpot_ms_range_basis=fractions.basis,
        hardware_class=hardware_class,
        tpot_ms_range_fractions=(fractions.lo, fractions.hi),
        tpot_ms_range_rows={
            "wanted": fractions.wanted,
            "matched": fractions.matched,
            "rows": len(fractions.rows),
            "lowest_fraction": fractions.low_row.label,
            "highest_fraction": fractions.high_row.label,
        },
    )


# -- FLOPs --------------------------------------------------------------------------------------------------------
def decode_attention_flops(n_layers: int, q_width: int, context: int) -> int:
    """FLOPs (2 per multiply-add) of one new token's attention over ``context`` cached tokens, one sequence:
    ``4 x n_layers x q_width x context``, where ``q_width`` is query heads x head dim (q.K and p.V, 2 FLOPs per
    multiply-add each). GQA shares K and V across query heads, not these multiplies."""
    return 4 * n_layers * q_width * context


def decode_flops(cfg: ModelConfig, context: int, batch: int = 1) -> int:
    """FLOPs of one decode step: 2 per parameter a token uses, per sequence, plus attention's 4 x context x heads
    x head dim per layer (``decode_attention_flops``). Dense attention only (MLA: ``mla_attention_flops``).

    The parameters a token uses are ``active_params(cfg)`` at batch 1: all of a dense model's, and for a mixture of
    experts the dense parts plus the ``top_k`` routed and the shared experts. Each sequence multiplies by its own
    experts only, so FLOPs scale with batch x per-token parameters, even where the batch as a whole reads more
    experts' bytes (``active_params(cfg, batch)``). Every parameter counts 2, the untied input table included
    (lesson 02 says why).
    """
    attention = decode_attention_flops(cfg.n_layers, cfg.n_heads * cfg.head_dim, context)
    return batch * (2 * active_params(cfg) + attention)


def prefill_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """FLOPs of a causal prefill of ``n_tokens`` (one sequence): token t attends over t keys, so attention sums to
    2 x layers x heads x head dim x T (T + 1), which is of order 2 T^2 d per layer."""
    attention = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * n_tokens * (n_tokens + 1)
    return 2 * active_params(cfg) * n_tokens + attention


def ridge_intensity(peak_flops_per_s: float, bandwidth_gbps: float) -> float:
    """The roofline's ridge point in FLOPs per byte: where compute time equals memory time,
    peak FLOP/s / (bandwidth in bytes/s, GB/s = 1e9 bytes/s)."""
    return peak_flops_per_s / (bandwidth_gbps * 1e9)


def roofline_time_ms(flops: float, n_bytes: float, peak_flops_per_s: float, bandwidth_gbps: float) -> float:
    """The roofline's time for a step, in ms: the slower of FLOPs / peak and bytes / bandwidth (not their sum)."""
    return max(flops / peak_flops_per_s, n_bytes / (bandwidth_gbps * 1e9)) * 1e3


def batch_for_tpot(
    target_ms: float, weight_bytes: float, kv_bytes_per_token: float, context: int, bandwidth_gbps: float
) -> float:
    """The batch (sequences) at which the byte model reaches ``target_ms`` per step, with ``weight_bytes`` read once
    and ``kv_bytes_per_token`` per cached token of each sequence at ``context`` tokens, at ``bandwidth_gbps``
    (GB/s). Fractional: the model is linear in batch."""
    return (target_ms / 1e3 * bandwidth_gbps * 1e9 - weight_bytes) / (context * kv_bytes_per_token)


def crossover_context(weight_bytes: float, kv_bytes_per_token: float, batch: int = 1) -> float:
    """Context (tokens, fractional) at which a step's KV bytes for ``batch`` sequences equal its weight bytes."""
    return weight_bytes / (batch * kv_bytes_per_token)


# -- speculative decoding ----------------------------------------------------------------------------------------
def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens one speculative verify step yields on average, when each of ``k`` drafts is accepted with probability
    ``acceptance`` given the ones before it were: ``1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)`` (the
    accepted drafts, plus the target's own token after them). ``k + 1`` at ``a = 1``; 1 at ``k = 0``."""
    require_fraction("acceptance", acceptance)
    require_int("k", k, 0)
    return float(k + 1) if acceptance == 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def acceptance_from_rate(rate: float, k: int) -> float:
    """The per-draft ``a`` at which ``k`` drafts per step are kept at ``rate`` = accepted / drafted.

    Serving systems report ``rate``; the byte model needs ``a``. They differ because a step stops judging at its
    first rejection: ``rate = (a + a^2 + ... + a^k) / k``, which equals ``a`` only at ``k = 1``. The rate rises
    with ``a``, so bisection finds the one ``a`` that gives it (to 1e-15; the sum is taken term by term because the
    closed form cancels badly near ``a = 1``).
    """
    require_fraction("rate", rate)
    require_int("k", k, 1)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(1, k + 1)) / k < rate else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SpeculativePrediction:
    """Bytes per generated token with speculative decoding, against plain decoding, from the byte model.

    A round is ``k`` draft steps and one verify step. The verify step runs the target over ``k + 1`` positions of
    each of the ``batch`` sequences: it streams each sequence's KV once (``k`` positions more than a plain step) and
    the weights those ``batch x (k + 1)`` tokens use. For a dense target that is every weight, as in a plain step;
    a mixture of experts routes ``batch x (k + 1)`` tokens, so it reads the experts a plain step of that many tokens
    would (``verify_bytes_per_step``, by ``expected_experts``). Mixtral at batch 1 and ``k = 4`` reads 2.7x a plain
    step's weights to verify, which eats most of what the accepted drafts save.

    - ``target_bytes_per_step``: the plain step the speedup is measured against.
    - ``verify_bytes_per_step``: the verify step (equal to the plain step where no count of it was given).
    - ``draft_bytes_per_step``: one draft step over the same ``batch`` sequences, one token each (0 for prompt
      lookup).

    ``speedup`` is plain bytes per token over speculative bytes per token; it assumes every step is bandwidth-bound,
    which a verify step of ``k + 1`` positions stays at batch 1 but not at large batch (lesson 02's roofline), and it
    leaves out the drafter's fixed per-step costs.
    """

    k: int
    acceptance: float
    tokens_per_step: float
    target_bytes_per_step: int
    draft_bytes_per_step: int
    bytes_per_round: int
    bytes_per_token: float
    speedup: float
    tpot_ms: float
    verify_bytes_per_step: int


def predict_speculative(
    target_bytes_per_step: int,
    k: int,
    acceptance: float,
    bandwidth_gbps: float,
    draft_bytes_per_step: int = 0,
    verify_bytes_per_step: int | None = None,
) -> SpeculativePrediction:
    """``SpeculativePrediction`` for ``k`` drafts per verify step at per-draft acceptance ``acceptance`` (the
    probability ``a`` that a draft is kept given the ones before it were; ``acceptance_from_rate`` converts the
    accepted / drafted share serving systems report). ``verify_bytes_per_step``: what the verify step reads
    (``verify_bytes_per_step(cfg, p, k)``); ``None`` charges it the plain step's bytes, which is right for a dense
    target up to the ``k`` extra positions' KV."""
    require_int("target_bytes_per_step", target_bytes_per_step)
    require_int("draft_bytes_per_step", draft_bytes_per_step, 0)
    verify = target_bytes_per_step if verify_bytes_per_step is None else verify_bytes_per_step
    require_int("verify_bytes_per_step", verify)
    tokens = expected_tokens_per_step(acceptance, k)
    per_round = verify + k * draft_bytes_per_step
    per_token = per_round / tokens
    return SpeculativePrediction(
        k=k,
        acceptance=acceptance,
        tokens_per_step=tokens,
        target_bytes_per_step=target_bytes_per_step,
        draft_bytes_per_step=draft_bytes_per_step,
        bytes_per_round=per_round,
        bytes_per_token=per_token,
        speedup=target_bytes_per_step / per_token,
        tpot_ms=predict_tpot_ms(per_token, bandwidth_gbps),
        verify_bytes_per_step=verify,
    )


def verify_bytes_per_step(cfg: ModelConfig, p: Prediction, k: int) -> int:
    """Bytes a verify step over ``k + 1`` positions of each of ``p.batch`` sequences reads, ``p``'s settings kept.

    Weights: what a step routing ``p.batch x (k + 1)`` tokens reads (``weight_bytes_read``: for a mixture of
    experts, the ``expected_experts`` of that many tokens; for a dense model, the same as a plain step, plus ``k``
    more input-embedding rows per sequence under ``input_embedding="rows"``). KV: each sequence's cache once, at
    ``p.context + k`` tokens (the drafted positions are written and attended to as well). At ``k = 0`` this is
    ``p.bytes_per_step``.
    """
    require_int("k", k, 0)
    weight_dtype = None if p.weight_dtype == "mixed" else p.weight_dtype
    weights = weight_bytes_read(cfg, weight_dtype, p.batch * (k + 1), p.weight_group_size, p.input_embedding)
    kv = kv_bytes_per_step(cfg, p.context + k, p.batch, p.kv_dtype, p.window, p.sinks, p.shared_prefix, p.group_size)
    return weights + kv


def best_speculation_k(
    target_bytes_per_step: int,
    acceptance: float,
    draft_bytes_per_step: int = 0,
    k_max: int = 16,
    verify_bytes: Callable[[int], int] | None = None,
) -> int:
    """The ``k`` in ``0 .. k_max`` with the fewest bytes per token (the smallest such ``k`` on a tie).

    ``verify_bytes``: the verify step's bytes for a given ``k`` (e.g. ``lambda k: verify_bytes_per_step(cfg, p,
    k)``); ``None`` charges every ``k`` the plain step's bytes.
    """
    require_int("k_max", k_max, 0)
    cost = [
        predict_speculative(
            target_bytes_per_step,
            k,
            acceptance,
            1.0,
            draft_bytes_per_step,
            None if verify_bytes is None else verify_bytes(k),
        ).bytes_per_token
        for k in range(k_max + 1)
    ]
    return cost.index(min(cost))


@dataclass(frozen=True)
class MLAAttentionFlops:
    """FLOPs (2 per multiply-add) of one layer's attention for one new token over ``context`` tokens, by part.

    Elementwise work (softmax, RoPE, norms) is left out: it is small beside these products.
    """

    context: int
    projections: int  # both paths: x -> query and latent (q up-projection too with q_lora_rank), and the output
    expand: int  # naive: up-project every cached latent to per-head K and V, 2 S r H (n + v)
    attend_expanded: int  # naive: q.K and p.V over per-head K/V, 2 S H (n + p + v)
    absorb: int  # absorbed: fold W_uk into the query and apply W_uv to the result, 2 H r (n + v), once per token
    attend_latent: int  # absorbed: scores against [c_kv | k_rope] and the weighted sum of c_kv, 2 S H (2 r + p)

    @property
    def naive(self) -> int:
        return self.projections + self.expand + self.attend_expanded

    @property
    def absorbed(self) -> int:
        return self.projections + self.absorb + self.attend_latent

    @property
    def absorption_extra(self) -> int:
        """What absorption costs beyond attention over per-head K/V, as MHA with a full cache would compute it."""
        return self.absorb + self.attend_latent - self.attend_expanded


def mla_attention_flops(cfg: ModelConfig, context: int) -> MLAAttentionFlops:
    """FLOPs of one decode token's attention in one MLA layer, attending over ``context`` tokens, both paths.

    For DeepSeek-V3 (H 128, r 512, p 64, n 128, v 128) each attended token costs 278,528 FLOPs absorbed against
    81,920 over per-head K/V (3.4x), in exchange for reading 576 cached elements instead of 40,960; the naive path
    spends 33,554,432 FLOPs per token re-expanding it (at 4,096 tokens: 138.1 GFLOP per layer naive, 1.52 absorbed).
    In bf16, absorbed attention does about 242 FLOPs per cached byte it reads (MHA: 1), above an H200's datasheet
    ratio of dense FLOP/s to bandwidth (989e12 / 4.8e12 = 206): on paper that part of the step is bound by compute,
    not by the bytes it reads.
    """
    m = cfg.mla
    if m is None:
        raise ValueError(f"cfg: {cfg.name} has no MLA shape; allowed: a config with mla=MLAConfig(...)")
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise ValueError(f"context: {context!r}; allowed: an integer >= 1 (the new token attends to itself)")
    h, r, p, n, v = cfg.n_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    q_in = m.q_lora_rank or h * (n + p)
    projections = 2 * cfg.d_model * (q_in + r + p) + 2 * h * v * cfg.d_model
    if m.q_lora_rank is not None:
        projections += 2 * m.q_lora_rank * h * (n + p)
    return MLAAttentionFlops(
        context=context,
        projections=projections,
        expand=2 * context * r * h * (n + v),
        attend_expanded=2 * context * h * (n + p + v),
        absorb=2 * h * r * (n + v),
        attend_latent=2 * context * h * (2 * r + p),
    )
