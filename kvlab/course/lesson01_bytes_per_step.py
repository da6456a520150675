"""Lesson 01, bytes per step: KV and weight bytes counted from a model's shape, TPOT and the batch for a target,
the audit of a circulating claim, and the FLOPs of decode attention."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvlab.course.grading import call_learner, close_to, config_label, exact_int, fail
from kvlab.roofline import (
    batch_for_tpot,
    decode_attention_flops,
    kv_bytes_per_token,
    kv_elements_per_token_per_layer,
    param_count,
    predict_tpot_ms,
)
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import get_model

__all__ = [
    "check_batch_for_tpot",
    "check_decode_attention_flops",
    "check_error_audit",
    "check_kv_bytes_per_token",
    "check_tpot_ms",
    "check_weight_bytes",
]

# Two shapes no real model has, whose bytes come out fractional at 0.5625 bytes per element (int4 with a 16-bit scale
# per 64 values): .75 and .25 of a byte over, so that truncating fails the first and rounding up the second.
_ODD_SHAPES = (
    ModelConfig(n_layers=5, d_model=124, n_heads=2, n_kv_heads=1, head_dim=62, d_ff=256, vocab_size=1000, name="odd-a"),
    ModelConfig(n_layers=5, d_model=116, n_heads=2, n_kv_heads=1, head_dim=58, d_ff=256, vocab_size=1000, name="odd-b"),
)


def _course_models() -> tuple[tuple[ModelConfig, float], ...]:
    return (
        (get_model("llama-3.1-70b"), 2),
        (get_model("llama-2-7b"), 2),
        (get_model("cpu-tiny"), 4),
        (get_model("llama-3.1-8b").replace(n_kv_heads=1, name="llama-3.1-8b-mqa"), 2),
        (get_model("deepseek-v3"), 2),
        (get_model("qwen3-8b"), 0.5),
        *((cfg, 0.5625) for cfg in _ODD_SHAPES),
    )


def _count_slips(exact: float) -> list[tuple[float, str]]:
    """Slips any byte count can make: bits for bytes, and an int other than the nearest."""
    return [
        (round(exact * 8), "It is 8 times the expected value: bits per element instead of bytes?"),
        (math.floor(exact), "It is the product truncated: round it to the nearest integer with round()."),
        (math.ceil(exact), "It is the product rounded up: round it to the nearest integer with round()."),
    ]


def _kv_slips(cfg: ModelConfig, size: float, exact: float) -> list[tuple[float, str]]:
    """The values a KV count takes with one named mistake, the likeliest first."""
    slips = []
    if cfg.mla is not None:
        per_head = round(2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * size)
        mla = "It counts per-head K and V, but MLA caches one latent of kv_lora_rank + qk_rope_head_dim per layer."
        slips.append((per_head, mla))
    elif cfg.n_heads != cfg.n_kv_heads:
        heads = "It counts the query heads (n_heads): K and V are cached once per KV head (n_kv_heads)."
        slips.append((round(exact * cfg.n_heads / cfg.n_kv_heads), heads))
    slips.append((round(exact / 2), "It is half the expected value: is the factor of 2 for K and V missing?"))
    slips.append((round(exact / cfg.n_layers), "It is one layer's bytes: multiply by n_layers."))
    return slips + _count_slips(exact)


def check_kv_bytes_per_token(
    fn: Callable[[ModelConfig, float], int],
    cases: Iterable[tuple[ModelConfig, float]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, bytes_per_element)`` -> bytes one token of one sequence caches, all layers, K and V.

    Expected: ``round(layers x elements per token per layer x bytes per element)``, as ``kv_bytes_per_token``.
    """
    fix = (
        "Per layer a token stores K and V for each KV head: 2 x kv_heads x head_dim elements; "
        "MLA stores one latent of kv_lora_rank + qk_rope_head_dim elements instead."
    )
    for cfg, size in _course_models() if cases is None else cases:
        exact = cfg.n_layers * kv_elements_per_token_per_layer(cfg) * size
        label = f"kv_bytes_per_token({config_label(cfg)}, bytes_per_element={size})"
        got = call_learner(label, fn, cfg, size)
        exact_int(label, got, round(exact), "bytes", fix, reveal, _kv_slips(cfg, size, exact))


def _dense_models() -> tuple[tuple[ModelConfig, float], ...]:
    return (
        (get_model("llama-3.1-70b"), 2),
        (get_model("cpu-tiny"), 4),
        (get_model("smollm2-135m"), 2),
        (get_model("qwen2.5-7b"), 1),
        *((cfg, 0.5625) for cfg in _ODD_SHAPES),  # fractional counts, .25 and .75 over
    )


def _weight_slips(cfg: ModelConfig, size: float) -> list[tuple[float, str]]:
    """The values a weight count takes with one named mistake."""
    params, d = param_count(cfg), cfg.d_model
    tied = "twice, but tie_embeddings is True" if cfg.tie_embeddings else "once, but tie_embeddings is False"
    kv_heads = "It gives the K and V projections n_heads heads: they are d x n_kv_heads x head_dim."
    norms = "It leaves out the norms: two of d per layer, one final."
    return [
        (round(param_count(cfg.replace(n_kv_heads=cfg.n_heads)) * size), kv_heads),
        (round(param_count(cfg.replace(tie_embeddings=not cfg.tie_embeddings)) * size), f"It counts the table {tied}."),
        (round((params - (2 * cfg.n_layers + 1) * d) * size), norms),
        (round((params - d) * size), "It leaves out the final norm (d weights)."),
        *_count_slips(params * size),
    ]


def check_weight_bytes(
    fn: Callable[[ModelConfig, float], int],
    cases: Iterable[tuple[ModelConfig, float]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, bytes_per_element)`` -> bytes of all parameters of a Llama-style shape, counted from the shape.

    Expected: ``round(param_count x bytes per element)``, as ``kvlab.roofline.weight_bytes``.
    """
    fix = (
        "Count embeddings (twice unless tied: input table and output head), per layer the Q, K, V, O projections "
        "(d x heads x head_dim for Q and O, d x kv_heads x head_dim for K and V), three d x d_ff MLP matrices "
        "and two norms of d, plus the final norm."
    )
    for cfg, size in _dense_models() if cases is None else cases:
        label = f"weight_bytes({config_label(cfg)}, bytes_per_element={size})"
        got = call_learner(label, fn, cfg, size)
        exact_int(label, got, round(param_count(cfg) * size), "bytes", fix, reveal, _weight_slips(cfg, size))


_TPOT_CASES = (
    (141_107_412_992, 327_680, 30_000, 1, 3350.0),
    (141_107_412_992, 327_680, 30_000, 26, 3350.0),
    (22_029_312, 8192, 4096, 4, 12.5),
)


def check_tpot_ms(fn: Callable[..., float], cases=_TPOT_CASES, reveal: bool = True) -> None:
    """``fn(weight_bytes, kv_bytes_per_token, context, batch, bandwidth_gbps)`` -> predicted TPOT in ms."""
    for w, kv, context, batch, gbps in cases:
        want = predict_tpot_ms(w + batch * context * kv, gbps)
        fix = "TPOT = (weight bytes + batch x context x KV bytes per token) / (bandwidth in bytes/s), in ms."
        label = f"tpot_ms({w}, {kv}, context={context}, batch={batch}, {gbps:g} GB/s)"
        no_batch = "It leaves out the batch: each sequence in it reads its own cache, the weights are read once."
        slips = ((predict_tpot_ms(w + context * kv, gbps), no_batch),) if batch != 1 else ()
        close_to(label, call_learner(label, fn, w, kv, context, batch, gbps), want, "ms", fix, reveal, slips=slips)


_BATCH_CASES = (
    (120.0, 141_107_412_992, 327_680, 30_000, 3350.0),
    (50.0, 16_000_000_000, 131_072, 8192, 2039.0),
)


def check_batch_for_tpot(fn: Callable[..., float], cases=_BATCH_CASES, reveal: bool = True) -> None:
    """``fn(target_ms, weight_bytes, kv_bytes_per_token, context, bandwidth_gbps)`` -> batch (a float)."""
    for target, w, kv, context, gbps in cases:
        label = f"batch_for_tpot({target:g} ms, {w}, {kv}, {context}, {gbps:g} GB/s)"
        fix = "Solve target = (weights + batch x context x KV per token) / bandwidth for batch; keep it fractional."
        close_to(
            label,
            call_learner(label, fn, target, w, kv, context, gbps),
            batch_for_tpot(target, w, kv, context, gbps),
            "sequences",
            fix,
            reveal,
        )


def _audit_models() -> tuple[tuple[ModelConfig, int], ...]:
    return (
        (get_model("llama-3.1-70b"), 32_768),
        (get_model("llama-3.1-70b"), 30_000),
        (get_model("qwen3-8b"), 4096),
    )


_EXPRESSION = 2 * 80 * 8192 * 32 * 2  # the circulating "MHA at 32k" expression, evaluated as written


def check_error_audit(
    fn: Callable[[ModelConfig, int], Mapping[str, Any]],
    expression_bytes: int | None = None,
    cases: Iterable[tuple[ModelConfig, int]] | None = None,
    reveal: bool = True,
) -> None:
    """The circulating claims about a model's KV cache, audited, for one sequence in BF16.

    ``expression_bytes`` (checked when given): what ``2 x 80 x 8192 x 32 x 2`` equals. ``fn(cfg, context)`` ->
    ``{"mha_kv_bytes": int, "kv_bytes": int, "kv_over_weights": float}``: the cache at ``context`` tokens with one
    KV head per query head (MHA, what the claims assume), the cache with the model's own KV heads, and that over
    the bytes of all weights ("the KV cache rivals the weights" says about 1). Dense models without MLA only.
    """
    if expression_bytes is not None:
        slips = (
            (_EXPRESSION * 1000, "It is 1000 times what the expression equals: the product is MB, not GB."),
            (83.9e9, "That is the claim's 83.9 GB: evaluate the expression itself."),
        )
        fix = "Evaluate the expression as written: it has no sequence length in it."
        exact_int("expression_bytes", expression_bytes, _EXPRESSION, "bytes", fix, True, slips)
    keys = ("mha_kv_bytes", "kv_bytes", "kv_over_weights")
    for cfg, context in _audit_models() if cases is None else cases:
        call = f"audit({config_label(cfg)}, context={context})"
        got = call_learner(call, fn, cfg, context)
        if not isinstance(got, Mapping) or not set(keys) <= set(got):
            fail(call, got, f"a dict with the keys {', '.join(keys)}", "Return a dict with all three keys.")
        mha = kv_bytes_per_token(cfg.replace(n_kv_heads=cfg.n_heads), "bf16")
        own, weights = kv_bytes_per_token(cfg, "bf16"), round(param_count(cfg) * 2)
        fix = "KV bytes = 2 x layers x KV heads x head_dim x 2 bytes (BF16) x context tokens"
        # audit builds on exercises 1 and 2: a fault there shows up here, and the message must say where to look
        uses = " audit uses kv_bytes_per_token and weight_bytes (exercises 1 and 2): if their checks fail, fix those."
        one_token = "It is one token's bytes: multiply by the context."
        in_k = "It puts the context in thousands (32 for 32k) where the number of tokens belongs."
        mha_slips = ((mha, one_token), (mha * round(context / 1024), in_k), (mha * round(context / 1000), in_k))
        exact_int(
            f"{call}['mha_kv_bytes']",
            got["mha_kv_bytes"],
            mha * context,
            "bytes",
            f"{fix}, with KV heads = n_heads.{uses}",
            reveal,
            mha_slips,
        )
        own_slips = ((own, one_token), (mha * context, "It is the MHA cache: use the model's own n_kv_heads."))
        exact_int(f"{call}['kv_bytes']", got["kv_bytes"], own * context, "bytes", f"{fix}.{uses}", reveal, own_slips)
        ratio_slips = (
            (weights / (own * context), "It is weights / KV: return KV / weights."),
            (mha * context / weights, "It uses the MHA cache: use the model's own KV heads."),
        )
        close_to(
            f"{call}['kv_over_weights']",
            got["kv_over_weights"],
            own * context / weights,
            "KV bytes per weight byte",
            "KV bytes at this context over the bytes of all weights, both in BF16." + uses,
            reveal,
            slips=ratio_slips,
        )


_ATTN_FLOP_CASES = ((80, 8192, 32_768), (32, 4096, 1), (4, 256, 4096))


def check_decode_attention_flops(
    fn: Callable[[int, int, int], int], cases=_ATTN_FLOP_CASES, reveal: bool = True
) -> None:
    """``fn(n_layers, d_model, context)`` -> attention FLOPs of one decode step (one new token, one sequence)."""
    for layers, d, context in cases:
        label = f"decode_attention_flops({layers}, {d}, {context})"
        fix = (
            "One new query against `context` keys: every query head multiplies its head_dim-wide query with each "
            "cached key (q.K, 2 x context x n_heads x head_dim = 2 x context x d FLOPs) and the values likewise "
            "(p.V, as many again), per layer; GQA shares K and V, not these multiplies. There is no context^2: "
            "the past queries are not recomputed."
        )
        want = decode_attention_flops(layers, d, context)
        exact_int(label, call_learner(label, fn, layers, d, context), want, "FLOPs", fix, reveal)
