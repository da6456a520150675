"""The bytes-per-step model of decoding: arithmetic only, with no torch import.

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

The ceilings these counts are judged against are measured by ``kvlab.machine`` (bandwidth, matmul FLOP/s), or come
from datasheets (``kvlab.spec.presets``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from functools import lru_cache

from kvlab.spec.config import WEIGHT_COMPONENTS, ModelConfig
from kvlab.spec.dtypes import BYTES_PER_ELEMENT, GROUP_STAT_BYTES, KV_DTYPES, KV_GROUP_STATS, canonical_dtype
from kvlab.spec.keep import SinksAndWindow
from kvlab.spec.published import QUANTIZED_BYTES_PER_PARAM, FractionRange, matching_fraction_range
from kvlab.spec.validation import require_int

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
    rule = SinksAndWindow(window, sinks)
    for layer_window, n_layers in _layers_by_window(cfg):
        for start, end in rule.spans(context - 1, context, layer_window):  # what the step's one query sees
            in_prefix = max(0, min(end, shared_prefix) - start)
            shared += n_layers * in_prefix
            per_sequence += n_layers * (end - start - in_prefix)
    return TokensRead(shared, per_sequence)


@lru_cache(maxsize=64)
def _layers_by_window(cfg: ModelConfig) -> tuple[tuple[int | None, int], ...]:
    """``(window, n_layers)`` per distinct layer window: layers with the same window read the same tokens, so
    ``kv_tokens_read`` makes one pass per window (a simulated clock asks it for every row of every step)."""
    return tuple(Counter(cfg.layer_windows or (None,) * cfg.n_layers).items())


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
