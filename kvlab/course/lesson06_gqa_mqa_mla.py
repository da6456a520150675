"""Lesson 06, GQA, MQA and MLA: the KV bytes of each layout at equal width, the measured slopes of fewer KV heads
against their byte ratios, the slope split into a part per KV head and a part per query head, MLA's latent cache
against the MHA cache it replaces, absorbed against naive decoding, and the FLOPs per byte that absorption costs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

from kvlab.course.grading import (
    call_learner,
    check_slope_ratios,
    close_to,
    config_label,
    exact_int,
    fail,
    slopes_over,
    timed_together,
)
from kvlab.course.measured import Reading, reading, tell
from kvlab.measure.sweep import Sweep
from kvlab.metrics import fit_line
from kvlab.roofline import (
    active_params,
    kv_bytes_per_step,
    kv_bytes_per_token,
    kv_element_bytes,
    kv_elements_per_token_per_layer,
    mla_attention_flops,
    weight_bytes_read,
)
from kvlab.spec.config import MLAConfig, ModelConfig
from kvlab.spec.presets import get_model

__all__ = [
    "ABSORBED_MAX_SHARE",
    "ABSORBED_NAIVE_MIN_R2",
    "LAYOUT_MIN_OF_BYTES",
    "LAYOUT_MIN_R2",
    "absorbed_reading",
    "check_absorbed_intensity",
    "check_absorbed_share",
    "check_absorbed_step",
    "check_layout_ratios",
    "check_mla_kv_bytes",
    "check_predict_layouts",
    "check_query_side",
    "check_split_slope",
    "layout_reading",
]


# -- exercise 1: the layouts of one width ---------------------------------------------------------------------------
def _layout_models() -> tuple[ModelConfig, ...]:
    # qwen3-4b's head_dim (128) is not d_model / n_heads (80): a count that derives it fails there. smollm2-135m's 9
    # heads have divisors 1, 3 and 9: a learner who halves n_heads to list the layouts fails there.
    return get_model("cpu-small"), get_model("llama-3.1-8b"), get_model("qwen3-4b"), get_model("smollm2-135m")


def _layout_slips(cfg: ModelConfig, n_kv_heads: int, exact: int) -> list[tuple[float, str]]:
    """The values a layout's KV bytes take with one named mistake, the likeliest first."""
    slips: list[tuple[float, str]] = []
    if n_kv_heads != cfg.n_kv_heads:
        own = "It is the bytes of the config's own layout (cfg.n_kv_heads): use the n_kv_heads of the layout asked."
        slips.append((kv_bytes_per_token(cfg), own))
    if n_kv_heads != cfg.n_heads:
        mha = "It counts n_heads KV heads: a layout caches K and V once per KV head, n_kv_heads of them."
        slips.append((kv_bytes_per_token(cfg.replace(n_kv_heads=cfg.n_heads)), mha))
    derived = cfg.d_model // cfg.n_heads
    if derived != cfg.head_dim:
        wrong = round(2 * cfg.n_layers * n_kv_heads * derived * kv_element_bytes(cfg.dtype))
        slips.append((wrong, f"It takes head_dim as d_model / n_heads ({derived}); use cfg.head_dim ({cfg.head_dim})."))
    slips.append((exact / cfg.n_layers, "It is one layer's bytes: multiply by n_layers."))
    slips.append((exact * 8, "It is 8 times the expected value: bits per element instead of bytes?"))
    return slips


def check_predict_layouts(
    fn: Callable[[ModelConfig], Mapping[int, tuple[int, float]]],
    cases: Iterable[ModelConfig] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg)`` -> ``{n_kv_heads: (kv_bytes_per_token, ratio_to_mha)}`` for every layout of ``cfg``'s width.

    The layouts are every ``n_kv_heads`` that divides ``n_heads`` (1 is MQA, ``n_heads`` is MHA); each keeps
    ``d_model``, ``n_heads``, ``head_dim``, the layers and the dtype. Expected: ``kv_bytes_per_token`` of
    ``cfg.replace(n_kv_heads=...)``, and its ratio to the MHA layout's, the slope ratio the bytes predict.
    """
    for cfg in _layout_models() if cases is None else cases:
        label = f"predict_layouts({config_label(cfg)}, {cfg.n_heads} query heads)"
        got = call_learner(label, fn, cfg)
        divisors = [k for k in range(1, cfg.n_heads + 1) if cfg.n_heads % k == 0]
        if not isinstance(got, Mapping):
            fail(label, type(got).__name__, "a dict {n_kv_heads: (bytes, ratio)}", "Return a dict.")
        if sorted(got) != divisors:
            fail(
                f"{label} keys",
                sorted(got),
                f"every divisor of n_heads={cfg.n_heads}, 1 and {cfg.n_heads} included",
                "A layout groups n_heads / n_kv_heads query heads on each KV head, so n_kv_heads must divide n_heads.",
            )
        mha_bytes = kv_bytes_per_token(cfg.replace(n_kv_heads=cfg.n_heads))
        for n_kv_heads in divisors:
            entry = got[n_kv_heads]
            quantity = f"{label}[{n_kv_heads}]"
            if not (isinstance(entry, Sequence) and len(entry) == 2):
                fail(quantity, entry, "a pair (kv_bytes_per_token, ratio_to_mha)", "Return two numbers per layout.")
            exact = kv_bytes_per_token(cfg.replace(n_kv_heads=n_kv_heads))
            fix = (
                "Not the bytes section 1 (exercise 1's text) counts for this layout: check what it caches per "
                "token, per layer and per KV head, and at how many bytes per element."
            )
            exact_int(f"{quantity} bytes", entry[0], exact, "bytes", fix, reveal, _layout_slips(cfg, n_kv_heads, exact))
            inverted = ((mha_bytes / exact, "It is inverted: the layout's bytes over MHA's, not MHA's over it."),)
            fix = "Not the ratio exercise 1 (section 1) asks for: compare with the MHA layout at this width."
            close_to(f"{quantity} ratio", entry[1], exact / mha_bytes, "a ratio", fix, reveal, slips=inverted)


# -- exercise 2: the measured slopes against the byte ratios ----------------------------------------------------------
# A run shows the lesson's effect (layout_reading) by the criteria the lesson states:
# - every layout's line is straight: R² at least LAYOUT_MIN_R2;
# - the slopes fall as the KV heads do: each layout flatter than the one with more KV heads, MHA steepest;
# - no layout flatter than LAYOUT_MIN_OF_BYTES x the ratio its KV bytes predict: a step still reads a layout's
#   cached bytes, and every query head still does its own work over them, so a layout cannot beat its bytes by much.
# Measured with lesson 06's solution on the course's 2-core AMD EPYC (32 MiB L3), one thread, other jobs on the same
# cores (load average 4-10): quick mode (cpu-tiny, 1k-8k tokens), 42 runs: GQA-2 0.17-1.67 x MHA (median 0.81), MQA
# 0.07-1.19 (median 0.53), the outliers with scattered lines (R² 0.01-0.20); full mode (cpu-small, 2k-16k), 14 runs:
# GQA-4 0.51-1.81, GQA-2 0.27-1.12, MQA 0.13-0.60. In a learner's 10 quick runs at load 8-9 the slopes did not fall
# in 6, so a run can fail to show the effect even when every line is straight; such a run is read as not showing it,
# never as confirming it. Where the slopes do fall, the least-squares line of slope against n_kv_heads (exercise 3)
# has a positive cost per KV head, which section 3's explanation needs.
LAYOUT_MIN_R2 = 0.8
LAYOUT_MIN_OF_BYTES = 0.5


def layout_reading(sweeps: Mapping[int, Sweep]) -> Reading:
    """Whether ``{n_kv_heads: Sweep}`` shows the lesson's effect: straight lines whose slopes fall with the KV heads,
    none far below its bytes."""
    mha = _mha_key(sweeps)
    ratios = slopes_over(sweeps, mha)
    byte_ratios = {key: s.kv_bytes_per_token / sweeps[mha].kv_bytes_per_token for key, s in sweeps.items()}
    heads = sorted(sweeps, reverse=True)
    r2 = min(s.fit.r2 for s in sweeps.values())
    unmet = []
    if r2 < LAYOUT_MIN_R2:
        unmet.append(f"a line is not straight (lowest R² {r2:.2f}, under {LAYOUT_MIN_R2})")
    rising = [
        f"{fewer} KV heads ({ratios[fewer]:.2f}) not flatter than {more} ({ratios[more]:.2f})"
        for more, fewer in pairwise(heads)
        if not ratios[fewer] < ratios[more]
    ]
    if rising:
        unmet.append("the slopes do not fall with the KV heads: " + ", ".join(rising))
    beaten = [f"{key} KV heads" for key in heads if ratios[key] < LAYOUT_MIN_OF_BYTES * byte_ratios[key]]
    if beaten:
        unmet.append(f"{', '.join(beaten)} under {LAYOUT_MIN_OF_BYTES} x the byte ratio: faster than the bytes allow")
    numbers = "slope x MHA: " + ", ".join(f"{key} KV heads {ratios[key]:.3f}" for key in heads)
    return reading(f"{numbers}; lowest R² {r2:.2f}", unmet)


def _mha_key(sweeps: Mapping[int, Sweep]) -> int:
    return max(sweeps)


def _check_layout_sweeps(sweeps: Any, name: str = "sweeps") -> None:
    """``sweeps`` must be ``{n_kv_heads: Sweep}`` measured together: one bandwidth object, the same contexts."""
    fix = "Pass the dict the layout cell made: {n_kv_heads: Sweep}, MHA (n_kv_heads = n_heads) included."
    if not isinstance(sweeps, Mapping) or len(sweeps) < 2:
        fail(name, type(sweeps).__name__, "a dict of at least two sweeps, keyed by n_kv_heads", fix)
    for key, sweep in sweeps.items():
        if not (isinstance(key, int) and isinstance(sweep, Sweep)):
            fail(f"{name}[{key!r}]", type(sweep).__name__, "a kvlab.measure.sweep.Sweep under an int n_kv_heads", fix)
    timed_together({f"{name}[{key}]": sweep for key, sweep in sweeps.items()}, fix)


def check_layout_ratios(measured_ratios: Mapping[int, float], sweeps: Mapping[int, Sweep]) -> None:
    """Each layout's measured slope over MHA's, from your sweeps: ``measured_ratios[n]`` is ``sweeps[n]``'s fitted
    slope over the MHA sweep's (the largest key). Graded on that arithmetic alone; ``layout_reading`` says whether
    the sweeps showed the slopes falling with the KV heads."""
    _check_layout_sweeps(sweeps)
    fix = "Not the ratio exercise 2 (section 2) asks for: use the fitted slopes of the sweeps the cell made."
    check_slope_ratios("measured_ratios", measured_ratios, sweeps, _mha_key(sweeps), fix, "layout", "MHA")
    tell("the slopes falling as the KV heads do", layout_reading(sweeps))


# -- exercise 3: a part per KV head, a part per query head -----------------------------------------------------------
_SPLIT_CASES = (((8, 4, 2, 1), (2.30, 1.25, 0.71, 0.45)), ((4, 1), (1.0, 0.4)), ((16, 8, 4), (3.3, 1.8, 1.1)))


def check_split_slope(
    fn: Callable[[Sequence[int], Sequence[float]], tuple[float, float]],
    sweeps: Mapping[int, Sweep] | None = None,
    cases: Iterable[tuple[Sequence[int], Sequence[float]]] = _SPLIT_CASES,
    reveal: bool = True,
) -> None:
    """``fn(kv_heads, slopes_us)`` -> ``(a_us, b_us)``, the least-squares line ``slope = a x n_kv_heads + b``.

    With ``sweeps``, first on their own slopes (µs per token), sorted by ``n_kv_heads``: consistency with your data.
    """
    data = []
    if sweeps is not None:
        _check_layout_sweeps(sweeps)
        data.append((sorted(sweeps), [sweeps[key].fit.slope * 1e3 for key in sorted(sweeps)]))
    for kv_heads, slopes in [*data, *cases]:
        label = f"split_slope({list(kv_heads)}, {[round(s, 4) for s in slopes]})"
        got = call_learner(label, fn, list(kv_heads), list(slopes))
        if not (isinstance(got, Sequence) and len(got) == 2):
            fail(label, got, "a pair (a_us, b_us)", "Return the slope per KV head and the part left at 0 KV heads.")
        ref = fit_line(kv_heads, slopes)
        swapped = ((ref.intercept, "It is the intercept b: return (a, b), the slope per KV head first."),)
        fix = "Fit the ordinary least-squares line of the slopes against n_kv_heads; check which list is x."
        close_to(f"{label} a", got[0], ref.slope, "µs per token per KV head", fix, reveal, rel=1e-6, slips=swapped)
        swapped = ((ref.slope, "It is the slope a: return (a, b), the intercept second."),)
        close_to(f"{label} b", got[1], ref.intercept, "µs per token", fix, reveal, rel=1e-6, slips=swapped)


def check_query_side(query_side_us: float, sweeps: Mapping[int, Sweep], one_head_sweep: Sweep) -> None:
    """The query side's part of the slope, measured: MQA against the same model with one query head.

    Both read one KV head's bytes per token and layer, so their slopes differ only by the work of the extra
    ``n_heads - 1`` query heads; scaled to all ``n_heads`` heads: ``(MQA slope - one head's) x n_heads /
    (n_heads - 1)``, in µs per token. Consistency with your sweeps, not a band.
    """
    _check_layout_sweeps(sweeps)
    if 1 not in sweeps:
        fail("sweeps", sorted(sweeps), "an MQA sweep (key 1) among them", "Sweep n_kv_heads = 1 too.")
    fix = "Pass the sweep of the model with n_heads = 1, timed in the same cell as the layouts."
    timed_together({"sweeps[1]": sweeps[1], "one_head_sweep": one_head_sweep}, fix)
    n_heads = _mha_key(sweeps)
    difference = (sweeps[1].fit.slope - one_head_sweep.fit.slope) * 1e3
    slips = (
        (difference, f"It is the extra {n_heads - 1} query heads' work: scale it to all {n_heads} of them."),
        (difference / (n_heads - 1), "It is one query head's work: multiply by n_heads for all of them."),
        (difference * n_heads / (n_heads - 1) / 1e3, "It is in ms per token: return µs (x 1000)."),
    )
    fix = (
        "Not the query side exercise 4 (section 3) defines: check which two slopes it compares, how it scales them "
        "to every query head, and the unit (µs per token)."
    )
    want = difference * n_heads / (n_heads - 1)
    close_to("query_side_us", query_side_us, want, "µs per token", fix, True, rel=1e-6, slips=slips)


# -- exercise 5: MLA's latent against the MHA cache it replaces ------------------------------------------------------
def _course_mla(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with MLA in DeepSeek's proportions at its own head size D: latent rank 2D, RoPE key D/2, no-RoPE
    query/key D, value D (DeepSeek-V3: D = 128, rank 512 = 4D, RoPE 64). The lesson's runnable MLA model."""
    d = cfg.head_dim
    mla = MLAConfig(kv_lora_rank=2 * d, qk_rope_head_dim=d // 2, qk_nope_head_dim=d, v_head_dim=d)
    return cfg.replace(mla=mla, head_dim=None, name=f"{cfg.name}-mla")


def _mla_models() -> tuple[tuple[ModelConfig, float], ...]:
    return (
        (get_model("deepseek-v3"), 2),
        (_course_mla(get_model("cpu-tiny")), 4),
        (_course_mla(get_model("cpu-small")), 4),
        (get_model("deepseek-v3"), 0.5625),  # int4 with a 16-bit scale per 64: fractional counts, rounded
        # int4 with a 16-bit scale per 48: 346.67 and 1386.67 bytes, where int() and round() part
        (_course_mla(get_model("cpu-tiny")), 0.5 + 2 / 48),
    )


TRUNCATED = "It truncates the fractional bytes (int()): round each to the nearest int (round()), as asked."


def _mha_equivalent_bytes(cfg: ModelConfig, size: float) -> float:
    """Bytes per token of the per-head K and V that MLA's heads use: n_heads x (qk_nope + qk_rope + v) per layer."""
    m = cfg.mla
    return cfg.n_layers * cfg.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * size


def check_mla_kv_bytes(
    fn: Callable[[ModelConfig, float], tuple[int, int]],
    cases: Iterable[tuple[ModelConfig, float]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, bytes_per_element)`` -> ``(latent_bytes, mha_bytes)`` per token, all layers, of an MLA model.

    ``latent_bytes``: the latent cache, ``kv_lora_rank + qk_rope_head_dim`` elements per layer (as
    ``kvlab.roofline.kv_bytes_per_token``); ``mha_bytes``: the per-head keys and values MLA's heads attend over,
    ``n_heads x (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)`` per layer, which an MHA cache would hold.
    """
    for cfg, size in _mla_models() if cases is None else cases:
        if cfg.mla is None:
            raise ValueError(f"cases: {cfg.name} has no MLA shape; allowed: MLA configs only")
        m = cfg.mla
        label = f"mla_kv_bytes({config_label(cfg)}, bytes_per_element={size})"
        got = call_learner(label, fn, cfg, size)
        if not (isinstance(got, Sequence) and len(got) == 2):
            fail(label, got, "a pair (latent_bytes, mha_bytes)", "Return two ints.")
        latent = cfg.n_layers * kv_elements_per_token_per_layer(cfg) * size
        latent_slips = (
            (
                round(latent * cfg.n_heads),
                "It counts a latent per head: MLA caches one latent per layer, shared by every head.",
            ),
            (
                round(cfg.n_layers * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * size),
                "It stores c_kv twice, as K and as V: the value is the key's first kv_lora_rank channels, stored once.",
            ),
            (round(cfg.n_layers * m.kv_lora_rank * size), "It leaves out the RoPE key (qk_rope_head_dim per layer)."),
            (round(latent / cfg.n_layers), "It is one layer's bytes: multiply by n_layers."),
            (math.floor(latent), TRUNCATED),
        )
        fix = "Not what MLA caches per token: section 4 (exercise 5's text) says what one layer holds for a token."
        exact_int(f"{label} latent_bytes", got[0], round(latent), "bytes", fix, reveal, latent_slips)
        mha = _mha_equivalent_bytes(cfg, size)
        mha_slips = (
            (
                round(2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * size),
                "It gives V the key's width: V is v_head_dim.",
            ),
            (
                round(cfg.n_layers * cfg.n_heads * (m.qk_nope_head_dim + m.v_head_dim) * size),
                "It leaves out each head's RoPE key part (qk_rope_head_dim).",
            ),
            (round(mha / cfg.n_layers), "It is one layer's bytes: multiply by n_layers."),
            (math.floor(mha), TRUNCATED),
        )
        fix = "Not the per-head K/V of the same heads: section 4 (exercise 5's text) gives each head's key and value."
        exact_int(f"{label} mha_bytes", got[1], round(mha), "bytes", fix, reveal, mha_slips)


# -- exercise 6: absorbed against naive, measured --------------------------------------------------------------------
# The band for the absorbed path's slope as a share of the naive path's, the two timed interleaved on the lesson's MLA
# model. The naive path re-expands every cached latent to per-head keys and values at every step, 2 r H (n + v) FLOPs
# per cached token and layer, 57x the absorbed path's 2 H (2r + p) on the lesson's shape; on a CPU that runs at
# the matmul rate, far slower than reading the latent. Measured with the runs above: quick mode (128-1k tokens),
# 32 runs, -0.31 to 0.19 (median 0.07; the absorbed line is nearly flat, so its slope is mostly noise and can come
# out negative); full mode (256-2k tokens), 4 runs, -0.03 to 0.08. The naive line is clean (R² >= 0.94). At most
# half the naive slope leaves room for that noise and still fails sweeps passed the wrong way round (ratio 12 or more).
# absorbed_reading calls a run readable when the naive line climbs cleanly (slope > 0, R² at least
# ABSORBED_NAIVE_MIN_R2) and the absorbed slope is at most ABSORBED_MAX_SHARE of it, and above zero: the absorbed
# path still reads every cached latent, so a line that falls with the context is load tilting it (a learner
# playtest read -0.067 as readable before this floor).
ABSORBED_MAX_SHARE = 0.5
ABSORBED_NAIVE_MIN_R2 = 0.8


def absorbed_reading(naive_sweep: Sweep, absorbed_sweep: Sweep) -> Reading:
    """Whether the two sweeps show the lesson's effect: the naive line climbs, the absorbed one far less."""
    naive, absorbed = naive_sweep.fit, absorbed_sweep.fit
    if not (naive.slope > 0 and naive.r2 >= ABSORBED_NAIVE_MIN_R2):
        unmet = [f"the naive line did not climb cleanly (R² {naive.r2:.2f}, under {ABSORBED_NAIVE_MIN_R2})"]
        return reading(f"naive {naive.slope * 1e3:.3f} µs per token, absorbed {absorbed.slope * 1e3:.3f}", unmet)
    share = absorbed.slope / naive.slope
    unmet = []
    if share > ABSORBED_MAX_SHARE:
        unmet.append(f"the absorbed slope is {share:.2f} of the naive one")
    elif share <= 0:
        unmet.append("the absorbed line fell as the context grew, though it reads every cached latent: load tilted it")
    return reading(f"absorbed slope / naive slope {share:.3f} (naive R² {naive.r2:.2f})", unmet)


def check_absorbed_share(absorbed_share: float, naive_sweep: Sweep, absorbed_sweep: Sweep) -> None:
    """The absorbed path's measured slope over the naive path's, from your sweeps; graded on that arithmetic alone,
    and ``absorbed_reading`` says whether the sweeps showed the absorbed line far flatter."""
    sweeps = {"naive_sweep": naive_sweep, "absorbed_sweep": absorbed_sweep}
    timed_together(sweeps, "Pass the sweeps the naive/absorbed cell made.")
    want = absorbed_sweep.fit.slope / naive_sweep.fit.slope
    slips = ((1 / want, "It is inverted: the absorbed slope over the naive slope, not the naive over the absorbed."),)
    fix = "Not the share exercise 6 (section 5) asks for: use the fitted slopes of the naive and absorbed sweeps."
    close_to("absorbed_share", absorbed_share, want, "a ratio of slopes", fix, True, rel=1e-6, slips=slips)
    tell("the absorbed line far flatter than the naive one", absorbed_reading(naive_sweep, absorbed_sweep))


# -- exercise 7: the FLOPs per byte absorbed attention does ----------------------------------------------------------
def _intensity_models() -> tuple[tuple[ModelConfig, float], ...]:
    return (
        (get_model("deepseek-v3"), 2),
        (get_model("deepseek-v3"), 1),
        (_course_mla(get_model("cpu-tiny")), 4),
        (_course_mla(get_model("cpu-small")), 2),
    )


def check_absorbed_intensity(
    fn: Callable[[ModelConfig, float], float],
    cases: Iterable[tuple[ModelConfig, float]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, bytes_per_element)`` -> FLOPs per cached byte of absorbed MLA attention, in one layer.

    Each cached token costs ``2 H (2r + p)`` FLOPs (``mla_attention_flops(cfg, S).attend_latent / S``) and
    ``r + p`` elements of ``bytes_per_element``; the ratio does not depend on the context or the layers.
    """
    for cfg, size in _intensity_models() if cases is None else cases:
        if cfg.mla is None:
            raise ValueError(f"cases: {cfg.name} has no MLA shape; allowed: MLA configs only")
        m, h = cfg.mla, cfg.n_heads
        label = f"absorbed_intensity({config_label(cfg)}, bytes_per_element={size})"
        token_bytes = kv_elements_per_token_per_layer(cfg) * size
        want = mla_attention_flops(cfg, 1).attend_latent / token_bytes
        slips = (
            (2 * h * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / token_bytes, _MHA_FLOPS_SLIP),
            (2 * h * 2 * m.kv_lora_rank / token_bytes, "It leaves out the RoPE part of the scores (p per head)."),
            (2 * h * (m.kv_lora_rank + m.qk_rope_head_dim) / token_bytes, _ONE_PRODUCT_SLIP),
            (want * cfg.n_layers, "It divides by one layer's bytes but counts every layer's FLOPs, or the reverse."),
            (want / cfg.n_layers, "It divides by every layer's bytes but counts one layer's FLOPs."),
            (want / 8, "It divides by bits, not bytes."),
        )
        fix = (
            "Not the intensity exercise 7 (section 6) asks for: check the FLOPs absorbed attention does for one "
            "cached token and layer, and the bytes that token's cache entry holds."
        )
        close_to(label, call_learner(label, fn, cfg, size), want, "FLOP per byte", fix, reveal, slips=slips)


_MHA_FLOPS_SLIP = "It counts attention over per-head K/V, 2 H (n + p + v): absorbed attention works in the latent."
_ONE_PRODUCT_SLIP = "It counts the scores only: the weighted sum of the latents (2 H r per token) costs FLOPs too."


# -- exercise 8: a whole absorbed step, FLOPs and bytes ---------------------------------------------------------------
def _step_cases() -> tuple[tuple[ModelConfig, int, int], ...]:
    ds = get_model("deepseek-v3")
    return (ds, 4096, 1), (ds, 32_768, 64), (ds, 131_072, 7), (_course_mla(get_model("cpu-tiny")), 1024, 4)


def check_absorbed_step(
    fn: Callable[[ModelConfig, int, int], tuple[int, int]],
    cases: Iterable[tuple[ModelConfig, int, int]] | None = None,
    reveal: bool = True,
) -> None:
    """``fn(cfg, context, batch)`` -> ``(flops, n_bytes)`` of one absorbed decode step of an MLA model.

    FLOPs: per sequence, 2 per parameter a token uses (``active_params(cfg)``; absorbed attention applies each
    attention weight once per token, ``W_uk`` and ``W_uv`` included) plus, per layer, ``attend_latent`` over the
    context. Bytes: ``weight_bytes_read(cfg, batch=batch)`` (the checkpoint's dtypes, the experts the batch routes
    to) plus ``kv_bytes_per_step(cfg, context, batch)`` (the latents, in ``cfg.dtype``).
    """
    for cfg, context, batch in _step_cases() if cases is None else cases:
        if cfg.mla is None:
            raise ValueError(f"cases: {cfg.name} has no MLA shape; allowed: MLA configs only")
        label = f"absorbed_step({config_label(cfg)}, context={context}, batch={batch})"
        got = call_learner(label, fn, cfg, context, batch)
        if not (isinstance(got, Sequence) and len(got) == 2):
            fail(label, got, "a pair (flops, n_bytes)", "Return two ints.")
        per_token = 2 * active_params(cfg)
        f = mla_attention_flops(cfg, context)
        flops = batch * (per_token + cfg.n_layers * f.attend_latent)
        flop_slips = (
            (batch * (per_token + cfg.n_layers * (f.expand + f.attend_expanded)), _NAIVE_SLIP),
            (batch * (per_token + cfg.n_layers * f.attend_expanded), _MHA_FLOPS_SLIP),
            (batch * (per_token + cfg.n_layers * (f.absorb + f.attend_latent)), _ABSORB_TWICE_SLIP),
            (per_token + cfg.n_layers * f.attend_latent, "It is one sequence's FLOPs: every sequence does its own."),
            (batch * (2 * active_params(cfg, batch) + cfg.n_layers * f.attend_latent), _BATCH_PARAMS_SLIP),
        )
        fix = (
            "Not the FLOPs of one absorbed step: check each term exercise 8 (section 6) lists, and which of them "
            "every sequence does on its own."
        )
        exact_int(f"{label} flops", got[0], flops, "FLOPs", fix, reveal, flop_slips)
        weights, kv = weight_bytes_read(cfg, batch=batch), kv_bytes_per_step(cfg, context, batch)
        byte_slips = (
            (batch * weight_bytes_read(cfg) + kv, "It reads the weights once per sequence: a batch shares them."),
            (weight_bytes_read(cfg) + kv, "It reads one sequence's experts: pass batch to weight_bytes_read."),
            (
                weights + kv_bytes_per_step(cfg, context),
                "It reads one sequence's latents: each sequence reads its own cache.",
            ),
            (weights + round(batch * _mha_equivalent_bytes(cfg, kv_element_bytes(cfg.dtype)) * context), _MHA_KV_SLIP),
        )
        fix = "Not the bytes of one absorbed step: exercise 8 (section 6) says which reads a batch shares."
        exact_int(f"{label} n_bytes", got[1], weights + kv, "bytes", fix, reveal, byte_slips)


_NAIVE_SLIP = "It counts the naive path (re-expanding every cached latent): the absorbed step attends in the latent."
_ABSORB_TWICE_SLIP = (
    "It counts folding W_uk and W_uv (absorb) on top of active_params, which already holds those weights: count once."
)
_BATCH_PARAMS_SLIP = (
    "It counts every expert the batch routes to for each sequence: each sequence multiplies by its own experts "
    "only, active_params(cfg) at batch 1."
)
_MHA_KV_SLIP = "It reads per-head K/V: an absorbed step reads only the latents (roofline.kv_bytes_per_step)."
