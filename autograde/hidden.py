"""Hidden checks: the public checkers (``kvlab.course``, which the lessons import through ``kvlab.checks``) on inputs
no lesson shows, with expected values withheld.

A hidden test cell calls one of these in one line, for example ``hidden.check_kv_bytes_per_token(fn)``. The inputs
in ``CASES`` differ from the notebooks' examples (other shapes, dtypes, batches and timings), so a function that
only reproduces the public example fails; and every call passes ``reveal=False``, so a failure message names the
input but never the expected value.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlab.cache.base import CacheShape
from kvlab.course import (
    lesson00_orientation,
    lesson01_bytes_per_step,
    lesson02_roofline,
    lesson03_measuring_tpot,
    lesson04_batching,
    lesson05_prefix_caching,
    lesson06_gqa_mqa_mla,
    lesson07_window_sinks,
    lesson08_heavy_hitters,
    lesson09_kv_quantization,
    lesson10_speculative_decoding,
    lesson11_capstone_incident,
)
from kvlab.engine import Engine, Request, RequestResult, RunReport, SimulatedClock
from kvlab.metrics import RequestTiming
from kvlab.model.decoder import Decoder
from kvlab.roofline import kv_bytes_per_token, weight_bytes
from kvlab.spec.config import MLAConfig, ModelConfig, MoEConfig
from kvlab.spec.presets import get_model
from kvlab.spec.published import PublishedDecode

_GQA = ModelConfig(n_layers=6, d_model=384, n_heads=6, n_kv_heads=3, d_ff=1024, vocab_size=5003, name="hidden-gqa")
# head_dim differs from d_model / n_heads here, as in Gemma and Qwen3: a formula that derives it fails.
_MQA_TIED = ModelConfig(
    n_layers=11,
    d_model=640,
    n_heads=10,
    n_kv_heads=1,
    head_dim=80,
    d_ff=1728,
    vocab_size=32001,
    tie_embeddings=True,
    dtype="bf16",
    name="hidden-mqa",
)
_WIDE_HEADS = ModelConfig(
    n_layers=3, d_model=512, n_heads=4, n_kv_heads=2, head_dim=256, d_ff=2048, vocab_size=1000, name="hidden-wide"
)
# Fractional byte counts (.75 and .25 of a byte over at 0.5625 and 1.0625 bytes per element, int4 and int8 with a
# 16-bit scale per 64): truncating fails the first, rounding up the second, for the KV and the weight counts alike.
_ODD_A = ModelConfig(
    n_layers=3, d_model=198, n_heads=4, n_kv_heads=1, head_dim=50, d_ff=520, vocab_size=3001, name="hidden-odd-a"
)
_ODD_B = ModelConfig(
    n_layers=3,
    d_model=202,
    n_heads=4,
    n_kv_heads=1,
    head_dim=54,
    d_ff=600,
    vocab_size=2999,
    tie_embeddings=True,
    name="hidden-odd-b",
)
_MLA = ModelConfig(
    n_layers=13,
    d_model=1024,
    n_heads=16,
    vocab_size=32000,
    n_params=300_000_000,
    dtype="bf16",
    mla=MLAConfig(kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64),
    name="hidden-mla",
)
# Two routed experts of eight per token, one shared, the first layer dense: a decode_flops that counts every expert
# (param_count) instead of the ones a token uses (active_params) fails.
_MOE = ModelConfig(
    n_layers=4,
    d_model=256,
    n_heads=4,
    n_kv_heads=2,
    d_ff=768,
    vocab_size=3001,
    moe=MoEConfig(n_experts=8, top_k=2, expert_d_ff=128, n_shared_experts=1, n_dense_layers=1),
    name="hidden-moe",
)


def _published(weight_bytes: int, kv_per_token: int, gbps: float, batch: int, context: int, measured: float):
    """A made-up published row; only the fields achieved_fraction reads matter."""
    return PublishedDecode(
        model="hidden-model",
        weight_dtype="int4 g64",
        device="hidden-gpu",
        bandwidth_gbps=gbps,
        batch=batch,
        context=context,
        measured_tpot_ms=measured,
        predicted_tpot_ms=float("nan"),  # a learner must compute it, not read it
        fraction=float("nan"),
        source="hidden",
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        caveats="",
    )


CASES: dict[str, tuple] = {
    # lesson 00
    "check_quick_mode": (
        {"KVLAB_QUICK": "yes"},
        {"KVLAB_QUICK": ""},
        {"NBGRADER_EXECUTION": ""},
        {"PATH": "/usr/bin", "KVLAB_QUICK": "0"},
        {"KVLAB_QUICK": "0", "NBGRADER_EXECUTION": "feedback"},
    ),
    "check_copy_gbps": ((3e9, 0.7), (12_345, 3e-6)),
    "check_stream_ms": ((7.7e9, 819.0), (1, 1.0)),
    # lesson 01
    "check_kv_bytes_per_token": (
        (_GQA, 4),
        (_MQA_TIED, 2),
        (_WIDE_HEADS, 1),
        (_MLA, 2),
        (_GQA, 0.5),
        (_ODD_A, 1.0625),
        (_ODD_B, 0.5625),
    ),
    "check_weight_bytes": ((_GQA, 4), (_MQA_TIED, 2), (_WIDE_HEADS, 0.5), (_ODD_A, 0.5625), (_ODD_B, 1.0625)),
    "check_tpot_ms": ((16_060_000_000, 131_072, 8000, 3, 2039.0), (1e6, 1000, 1, 1, 1.0)),
    "check_batch_for_tpot": ((90.0, 65_000_000_000, 262_144, 12_000, 4800.0),),
    # Other models and contexts, so that pasted numbers fail; head_dim = d_model / n_heads and untied embeddings, so
    # that a slip in exercise 1 or 2 that only those exercises' hidden checks catch does not cost this one as well.
    "check_error_audit": ((_GQA, 12_345), (_GQA.replace(n_layers=9, n_kv_heads=2, name="hidden-gqa-9"), 65_539)),
    "check_decode_attention_flops": ((126, 16_384, 100_000), (2, 96, 7)),
    # lesson 02
    "check_ridge_intensity": ((1307e12, 5300.0), (121e12, 300.0)),
    "check_decode_flops": ((_GQA, 777, 3), (_WIDE_HEADS, 1, 1), (_MQA_TIED, 20_000, 32), (_MOE, 500, 4)),
    "check_prefill_flops": ((_GQA, 333), (_MQA_TIED, 2), (_WIDE_HEADS, 10_000), (_MOE, 64)),
    "check_roofline_time_ms": ((1e15, 1e9, 989e12, 3350.0), (3e9, 3e10, 1e12, 100.0)),
    "check_achieved_fraction": (
        _published(5_000_000_000, 131_072, 1008.0, 1, 4096, 9.1),
        _published(70_000_000_000, 327_680, 4800.0, 16, 2000, 41.0),
    ),
    "check_int8_weight_bytes": (_GQA, _MQA_TIED, _WIDE_HEADS),
    # lesson 03
    "check_request_metrics": ((0.9, 1.0, 1.25), (0.002, 0.0031, 0.0045, 0.0062, 0.0071), (0.04,)),
    "check_percentile": (((4.0, 9.0, 1.0, 7.0), 25), ((2.5, 2.5, 8.0), 100), ((1.0, 2.0, 3.0, 4.0, 100.0), 75)),
    "check_fit_tpot": (([1000, 3000, 9000, 27000], [41.0, 44.5, 57.0, 90.5]), ([1, 2], [0.5, 0.25])),
    "check_crossover_context": ((16_060_000_000, 131_072, 4), (1e6, 3.0, 7)),
}


def _hidden(checker: Callable[..., None]) -> Callable[[Callable], None]:
    name = checker.__name__

    def check(fn: Callable) -> None:
        checker(fn, cases=CASES[name], reveal=False)

    check.__name__ = name
    check.__doc__ = f"``{checker.__module__}.{name}`` on the hidden cases, expected values withheld."
    return check


check_quick_mode = _hidden(lesson00_orientation.check_quick_mode)
check_copy_gbps = _hidden(lesson00_orientation.check_copy_gbps)
check_stream_ms = _hidden(lesson00_orientation.check_stream_ms)
check_kv_bytes_per_token = _hidden(lesson01_bytes_per_step.check_kv_bytes_per_token)
check_weight_bytes = _hidden(lesson01_bytes_per_step.check_weight_bytes)
check_tpot_ms = _hidden(lesson01_bytes_per_step.check_tpot_ms)
check_batch_for_tpot = _hidden(lesson01_bytes_per_step.check_batch_for_tpot)
check_error_audit = _hidden(lesson01_bytes_per_step.check_error_audit)
check_decode_attention_flops = _hidden(lesson01_bytes_per_step.check_decode_attention_flops)
check_ridge_intensity = _hidden(lesson02_roofline.check_ridge_intensity)
check_decode_flops = _hidden(lesson02_roofline.check_decode_flops)
check_prefill_flops = _hidden(lesson02_roofline.check_prefill_flops)
check_roofline_time_ms = _hidden(lesson02_roofline.check_roofline_time_ms)
check_achieved_fraction = _hidden(lesson02_roofline.check_achieved_fraction)
check_int8_weight_bytes = _hidden(lesson02_roofline.check_int8_weight_bytes)
check_request_metrics = _hidden(lesson03_measuring_tpot.check_request_metrics)
check_percentile = _hidden(lesson03_measuring_tpot.check_percentile)
check_fit_tpot = _hidden(lesson03_measuring_tpot.check_fit_tpot)
check_crossover_context = _hidden(lesson03_measuring_tpot.check_crossover_context)


def check_concat_cache(make_cache: Callable) -> None:
    """The concatenating cache on a one-layer GQA model and a batch of 3, not the public check's shape."""
    lesson03_measuring_tpot.check_concat_cache(make_cache, cfg=_GQA.replace(n_layers=1, max_seq_len=64), batch=3)


# -- lesson 04 --


def _made_up_run(token_times: tuple[tuple[float, ...], ...], duration_s: float) -> RunReport:
    """A run report with these requests' token times (s since arrival); no times: a request the engine refused."""
    results = [
        RequestResult([3] * len(t), RequestTiming(t), error=None) if t else RequestResult([], None, error="refused")
        for t in token_times
    ]
    return RunReport(results, duration_s, 0, 0, 1, len(results), 1)


CASES.update(
    {
        # a MoE at batch 8 (more experts read than at 1), a tied bf16 MQA at batch 16, a GQA at an odd context
        "check_step_bytes": ((_GQA, 3, 777), (_MOE, 8, 100), (_MQA_TIED, 16, 5000), (_MOE, 1, 2048)),
        # a MoE in int8 K/V (its weights read are far fewer than it holds), weights that just do not fit, bf16
        "check_max_batch_for_memory": (
            (_MOE, weight_bytes(_MOE) + 3 * 999 * kv_bytes_per_token(_MOE, "int8") + 17, 999, "int8"),
            (_GQA, weight_bytes(_GQA) - 1, 64, None),
            (_MQA_TIED, 10**9, 12_345, None),
            (_GQA, 5 * 10**8, 100_000, "fp8"),
        ),
        "check_max_batch_in_pool": ((100, 32, 33), (17, 16, 16), (9, 4, 3), (33, 8, 25)),
        "check_allocation_waste": (
            ((7, 900, 64, 1), 1024, 16),
            ((5000, 12, 130), 8192, 128),
            ((33, 33, 33, 33, 33), 64, 32),
        ),
        "check_throughput_latency": (
            _made_up_run(((0.3, 0.5, 0.6, 0.65, 0.9, 1.0), (0.1,), (), (0.2, 0.28)), 1.1),
            _made_up_run(tuple((0.01 * i, 0.01 * i + 0.004 * (1 + i % 3), 0.01 * i + 0.02) for i in range(40)), 0.5),
        ),
    }
)
check_step_bytes = _hidden(lesson04_batching.check_step_bytes)
check_max_batch_for_memory = _hidden(lesson04_batching.check_max_batch_for_memory)
check_max_batch_in_pool = _hidden(lesson04_batching.check_max_batch_in_pool)
check_allocation_waste = _hidden(lesson04_batching.check_allocation_waste)


def check_throughput_latency(fn: Callable) -> None:
    """The made-up runs, and an engine's run on a simulated clock (deterministic) of a model and GPU the lesson does
    not use, with a one-token request and one the engine refuses (a prompt longer than its pool)."""
    model = Decoder(_GQA.replace(n_layers=1, max_seq_len=512), seed=3)
    prompts = [list(range(i, i + 9 + 7 * i)) for i in range(6)]
    requests = [
        Request(p, n, arrival_s=0.002 * i) for i, (p, n) in enumerate(zip(prompts, (5, 1, 9, 3, 12, 2), strict=True))
    ]
    requests.append(Request(list(range(300)), 4))
    clock = SimulatedClock.for_gpu(get_model("qwen3-8b"), "a100-80gb-sxm")
    run = Engine(model, n_blocks=12, block_size=8, max_batch=3, clock=clock).run(requests)
    cases = (*CASES["check_throughput_latency"], run)
    lesson04_batching.check_throughput_latency(fn, cases=cases, reveal=False)


# -- lesson 05 --

_L05_SYSTEM = tuple(range(500, 533))  # 33 tokens: one past a whole number of blocks of 4, 8 and 32
_L05_DOC = _L05_SYSTEM + tuple(range(900, 960))  # 93 tokens
CASES.update(
    {
        # other lengths and block sizes; a block of one repeated token; the same block at several positions
        "check_block_hashes": (
            ((3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5), 8),
            (tuple(range(50)), 7),
            ((42,) * 10 + (1, 2) * 6, 5),
            (tuple(range(31)), 32),
        ),
        "check_prefix_hit_tokens": (
            ((_L05_DOC,), _L05_DOC[:64], 32),  # two cached blocks, the prompt exactly two blocks: one is computed
            ((_L05_DOC,), _L05_DOC, 4),  # 23 cached blocks; the cap takes none of them (93 - 1 = 92 = 23 x 4)
            ((_L05_DOC,), _L05_SYSTEM + tuple(range(1, 20)), 4),  # the system prompt's 8 full blocks
            ((_L05_SYSTEM, _L05_DOC), _L05_DOC[:40] + (0,), 8),
            ((tuple(range(10)),), tuple(range(10)), 5),
        ),
        "check_turn_hits": (
            ((50, 7, 20, 1, 33), (10, 5, 1, 9, 2), 8),
            ((100, 28), (29, 4), 32),  # 100 + 29 - 1 = 128 stored: exactly four blocks
            ((4, 4, 4, 4, 4), (4, 4, 4, 4, 4), 4),
        ),
        "check_ttft_saved": (
            [
                {
                    "session": s,
                    "turn": t,
                    "message_len": 30 if t else 200,
                    "answer_len": 50,
                    "prompt_len": 200 + 80 * t,
                    "hit_tokens": (200 + 80 * t - 31) // 16 * 16 if t else 0,
                    "ttft_on_ms": on,
                    "ttft_off_ms": off,
                    "same_tokens": True,
                }
                for s, turns in enumerate(
                    [
                        [(9.0, 9.5), (4.0, 12.0), (5.0, 15.0)],
                        [(11.0, 10.0), (3.5, 13.0), (6.5, 14.0)],
                        [(8.0, 8.25), (7.0, 11.0), (4.5, 30.0)],
                    ]
                )
                for t, (on, off) in enumerate(turns)
            ],
        ),
        "check_blocks_needed": ((7, 333, 50, 16), (2, 48, 1, 16), (10, 129, 127, 64), (3, 5, 100, 4)),
        "check_cascade_bytes": (
            (32, 2048, 100, CacheShape(2, 1, 4)),
            (2, 7, 3, CacheShape(1, 3, 5, "bf16")),
            (5, 12345, 678, CacheShape(1, 1, 2, "fp16")),
        ),
    }
)
check_block_hashes = _hidden(lesson05_prefix_caching.check_block_hashes)
check_turn_hits = _hidden(lesson05_prefix_caching.check_turn_hits)
check_ttft_saved = _hidden(lesson05_prefix_caching.check_ttft_saved)
check_blocks_needed = _hidden(lesson05_prefix_caching.check_blocks_needed)
check_cascade_bytes = _hidden(lesson05_prefix_caching.check_cascade_bytes)


def check_prefix_hit_tokens(fn: Callable, block_hashes: Callable) -> None:
    """``lesson05_prefix_caching.check_prefix_hit_tokens`` on the hidden cases (with the learner's block_hashes)."""
    lesson05_prefix_caching.check_prefix_hit_tokens(
        fn, block_hashes, cases=CASES["check_prefix_hit_tokens"], reveal=False
    )


# -- lesson 06 --
# An MLA mixture of experts with a query latent, v_head_dim unlike qk_nope_head_dim and FP8 experts: a count that
# takes V as wide as the key, leaves out the query latent's weights, or reads every expert at every batch fails.
_MLA_MOE = ModelConfig(
    n_layers=7,
    d_model=768,
    n_heads=12,
    vocab_size=7001,
    dtype="bf16",
    mla=MLAConfig(kv_lora_rank=384, qk_rope_head_dim=48, qk_nope_head_dim=96, v_head_dim=80, q_lora_rank=512),
    moe=MoEConfig(n_experts=16, top_k=2, expert_d_ff=256, n_shared_experts=1, n_dense_layers=2),
    weight_dtypes=(("experts", "fp8"),),
    name="hidden-mla-moe",
)
CASES.update(
    {
        "check_predict_layouts": (_GQA, _MQA_TIED, _WIDE_HEADS, _ODD_A),
        "check_split_slope": (((6, 3, 2, 1), (3.1, 1.7, 1.2, 0.9)), ((32, 8, 1), (40.0, 11.5, 3.25))),
        "check_mla_kv_bytes": ((_MLA, 2), (_MLA_MOE, 1.0625), (_MLA_MOE, 0.5625)),
        "check_absorbed_intensity": ((_MLA, 2), (_MLA_MOE, 1), (_MLA_MOE, 0.5625)),
        "check_absorbed_step": ((_MLA, 5000, 3), (_MLA_MOE, 777, 16), (_MLA_MOE, 1, 1)),
    }
)
check_predict_layouts = _hidden(lesson06_gqa_mqa_mla.check_predict_layouts)
check_split_slope = _hidden(lesson06_gqa_mqa_mla.check_split_slope)
check_mla_kv_bytes = _hidden(lesson06_gqa_mqa_mla.check_mla_kv_bytes)
check_absorbed_intensity = _hidden(lesson06_gqa_mqa_mla.check_absorbed_intensity)
check_absorbed_step = _hidden(lesson06_gqa_mqa_mla.check_absorbed_step)


# -- lesson 07 (its hidden cases and checks go here) --
CASES.update(
    {
        # fewer tokens than sinks; one short of full, exactly full, the first eviction; no sinks; a window of 1
        "check_kept_positions": ((3, 4, 8), (11, 8, 4), (12, 8, 4), (13, 8, 4), (50, 7, 0), (30, 1, 3)),
        # before and right after the first eviction, no sinks, a window of 1, far past the window
        "check_reassigned_positions": ((12, 8, 4), (13, 8, 4), (77, 9, 0), (40, 1, 2), (100_000, 500, 3)),
        # GQA, a tied bf16 MQA whose head_dim is not d_model / n_heads, a context shorter than the window
        "check_window_bytes_read": (
            (_GQA, 9000, 1000, 7, "fp32"),
            (_MQA_TIED, 50_000, 2044, 4, "bf16"),
            (_WIDE_HEADS, 300, 1020, 4, "fp16"),
            (_MQA_TIED, 2048, 2044, 4, "fp32"),
        ),
        # the passkey at the window's oldest position and one before it; a sink and the first non-sink; a prompt
        # shorter than the window; one position before the oldest of a long prompt
        "check_passkey_kept": (
            (258, 0.5, 130, 0),
            (258, 0.5, 129, 0),
            (1000, 0.003, 100, 4),
            (1000, 0.004, 100, 4),
            (300, 0.2, 1000, 0),
            (4096, 0.75, 1024, 0),
        ),
        "check_largest_distance": (
            (5000, 100, 4, "original"),
            (5000, 100, 4, "reassigned"),
            (5000, 100, 0, "reassigned"),
            (50, 100, 4, "reassigned"),
            (105, 100, 4, "original"),
        ),
    }
)
check_kept_positions = _hidden(lesson07_window_sinks.check_kept_positions)
check_reassigned_positions = _hidden(lesson07_window_sinks.check_reassigned_positions)
check_window_bytes_read = _hidden(lesson07_window_sinks.check_window_bytes_read)
check_passkey_kept = _hidden(lesson07_window_sinks.check_passkey_kept)
check_largest_distance = _hidden(lesson07_window_sinks.check_largest_distance)

# -- lesson 08 (its hidden cases and checks go here) --
# Ties at the boundary, heavy 0 (a window of the recent alone), fewer tokens than the budget, one recent; a GQA bf16
# model at batch 5 exactly at the budget (no eviction read yet), an fp16 MQA past it; made-up score rows with ties;
# rebuilds at other sizes; chats with a rebuild at every turn.
CASES.update(
    {
        "check_h2o_keep": (
            lesson08_heavy_hitters.random_case(30, 8, 4, seed=101, ties=True),
            lesson08_heavy_hitters.random_case(15, 0, 5, seed=102),
            lesson08_heavy_hitters.random_case(5, 8, 2, seed=103),
            lesson08_heavy_hitters.random_case(64, 16, 1, seed=104, ties=True),
        ),
        "check_h2o_bytes_per_step": (
            (_GQA.replace(dtype="bf16"), 300, 200, 100, 5),
            (_MQA_TIED.replace(dtype="fp16"), 10_000, 96, 32, 2),
            (_WIDE_HEADS, 7, 3, 2, 1),
        ),
        "check_passkey_rank": (
            lesson08_heavy_hitters.rank_case(40, 17, seed=111, ties=True),
            lesson08_heavy_hitters.rank_case(7, 6, seed=112),
        ),
        "check_break_even_steps": (
            (lesson08_heavy_hitters.Rebuild("cap", 3, 5000, 1234, 100, 1234 * 2048, 3766 * 2048, 0.0421), 900.0),
            (lesson08_heavy_hitters.Rebuild("compaction", 1, 77, 50, 50, 50 * 64, 27 * 64, 0.0005), 1.5),
        ),
        "check_chat_time": (
            lesson08_heavy_hitters.made_up_turns(5, seed=121, rebuild_every=1),
            lesson08_heavy_hitters.made_up_turns(8, seed=122, rebuild_every=3),
        ),
    }
)
check_h2o_keep = _hidden(lesson08_heavy_hitters.check_h2o_keep)
check_h2o_bytes_per_step = _hidden(lesson08_heavy_hitters.check_h2o_bytes_per_step)
check_passkey_rank = _hidden(lesson08_heavy_hitters.check_passkey_rank)
check_break_even_steps = _hidden(lesson08_heavy_hitters.check_break_even_steps)
check_chat_time = _hidden(lesson08_heavy_hitters.check_chat_time)


# -- lesson 09 (its hidden cases and checks go here) --
# Other shapes, bit widths (5, 6: not the lesson's), a group size that divides one dim only, negative dims; int4
# with an odd last dim and ragged groups; a KIVI cache with residual 0, a bf16 MQA on the naive path, a context that
# leaves a partial group in the residual (129 - 64 = 65: two groups quantized), a head_dim (50) that is not a
# multiple of the group; other models and GPUs; attention data with other shapes, bits and groups.
CASES.update(
    {
        "check_quantize": (
            ((3, 2, 96, 48), 5, 24, 2, 21),
            ((1, 4, 40, 64), 8, 64, 3, 22),
            ((6, 128), 6, 16, -1, 23),
            ((2, 1, 32, 16), 4, 32, -2, 24),
        ),
        "check_dequantize": (
            ((2, 3, 48, 96), 6, 24, 3, 25),
            ((5, 64, 8), 3, 16, 1, 26),
            ((1, 1, 128, 32), 8, 128, -2, 27),
        ),
        "check_quantized_bytes": (
            ((3, 5, 77, 96), "int4", 64, 2),
            ((2, 7, 33), "fp8", 16, 1),
            ((1, 2, 257, 65), "int4", 32, 3),
            ((4, 1000), "int8", 128, 0),
        ),
        "check_kivi_bytes": (
            (_GQA, 5000, "int4", 32, 0, 2, "chunked"),
            (_MQA_TIED, 3001, "fp8", 64, 256, 1, "naive"),
            (_WIDE_HEADS, 129, "int8", 32, 64, 3, "chunked"),
            (_ODD_A, 777, "int4", 16, 100, 1, "chunked"),
        ),
        "check_fp8_kv_tpot": (
            (get_model("llama-3.1-70b"), 65_536, 3350.0),
            (_MQA_TIED, 12_345, 900.0),
            (get_model("qwen3-8b"), 4096, 1008.0),
        ),
        "check_kivi_error": (
            lesson09_kv_quantization.error_case(31, (1, 1, 4, 320, 64), 3, 32, "per-channel"),
            lesson09_kv_quantization.error_case(32, (2, 2, 2, 96, 48), 4, 16, "per-token"),
            lesson09_kv_quantization.error_case(33, (1, 2, 2, 128, 32), 6, 32, "per-channel"),
        ),
    }
)
check_quantize = _hidden(lesson09_kv_quantization.check_quantize)
check_dequantize = _hidden(lesson09_kv_quantization.check_dequantize)
check_quantized_bytes = _hidden(lesson09_kv_quantization.check_quantized_bytes)
check_kivi_bytes = _hidden(lesson09_kv_quantization.check_kivi_bytes)
check_fp8_kv_tpot = _hidden(lesson09_kv_quantization.check_fp8_kv_tpot)
check_kivi_error = _hidden(lesson09_kv_quantization.check_kivi_error)

# -- lesson 10 (its hidden cases and checks go here) --
# Other vocabularies and k; a rejection at the last draft, matches after a rejection, k = 1 both ways, a tie at the
# first draft; a = 0 exactly, a near 1, large k; counts with no acceptance at all and short last steps; other byte
# sizes (a draft almost as big as the target); verify costs of other shapes; other models, GPUs, batches and
# contexts (a made-up fp32 pair on an L4).
CASES.update(
    {
        "check_accept_greedy": (
            (300, 7, 7, 11),
            (300, 7, 6, 12),
            (300, 7, 3, 13, True),
            (17, 1, 0, 14),
            (17, 1, 1, 15),
            (64, 0, 0, 16),
            (40, 6, 0, 17, True, True),
        ),
        "check_expected_tokens": ((0.95, 15), (0.3, 2), (0.5, 0), (1.0, 1), (0.0, 0), (0.999, 7), (0.42, 11)),
        "check_acceptance_estimate": (
            ((0, 0, 0), (3, 3, 3)),
            ((7, 7, 2, 7, 0), (7, 7, 7, 7, 2)),
            ((1, 0, 1, 1, 0, 0), (1, 1, 1, 1, 1, 0)),
            ((6, 6, 5, 2), (6, 6, 5, 3)),
        ),
        "check_byte_speedup": (
            (123_456_789, 9_876_543, 7, 0.55),
            (2_000_000_000, 0, 12, 0.97),
            (1_000, 999, 2, 0.33),
            (5_000_000, 100_000, 0, 0.9),
        ),
        "check_refined_speedup": (
            (0.7, 3, {n: 4.0 * n**0.5 for n in range(1, 9)}, 0.3),
            (0.97, 6, {n: 20.0 + n for n in range(1, 10)}, 2.0),
            (0.5, 2, {1: 1.0, 2: 3.0, 3: 2.5}, 0.0),
        ),
        "check_spec_roofline": (
            ("llama-2-70b", "llama-2-7b", "a100-80gb-sxm", 4, 2048, 8, 0.76),
            ("llama-3.1-405b", "llama-3.1-8b", "b200-hgx", 32, 8192, 6, 0.85),
            (_GQA, _ODD_A, "l4", 3, 777, 3, 0.5),
            ("llama-3.1-70b", "llama-3.1-8b", "h200-sxm", 512, 1024, 2, 0.9),
        ),
    }
)
check_accept_greedy = _hidden(lesson10_speculative_decoding.check_accept_greedy)
check_expected_tokens = _hidden(lesson10_speculative_decoding.check_expected_tokens)
check_acceptance_estimate = _hidden(lesson10_speculative_decoding.check_acceptance_estimate)
check_byte_speedup = _hidden(lesson10_speculative_decoding.check_byte_speedup)
check_refined_speedup = _hidden(lesson10_speculative_decoding.check_refined_speedup)
check_spec_roofline = _hidden(lesson10_speculative_decoding.check_spec_roofline)


# -- lesson 11 --
# Other GPUs, dtypes and utilizations; a config of no preset; a ragged batch with a window on a model with local
# layers; ratios where the term that added the most bytes is not the one that grew the most.
CASES.update(
    {
        "check_pool_tokens": (
            ("llama-3.1-70b", "mi300x", "int8", 0.92),
            ("qwen3-4b", "rtx-4090", None, 0.8),
            (_MQA_TIED, "l4", "int4", 0.5),
        ),
        "check_step_terms": (
            ("qwen3-8b", (40960, 7, 1024, 20000), "int4", None, 0),
            ("gemma-3-27b", (131072, 2048), "fp8", 8192, 16),
            (_GQA, (1, 2, 3), None, 2, 1),
            ("gpt-oss-20b", (5000,) * 3, None, None, 0),
        ),
        "check_grown_term": (
            ({"weights": 7e9, "kv": 3e9}, {"weights": 7e9, "kv": 3.3e9}),
            ({"weights": 1e9, "kv": 8e9}, {"weights": 4e9, "kv": 24e9}),
            ({"weights": 30e9, "kv": 1e9}, {"weights": 30e9, "kv": 9e9}),  # grew most, yet smaller late
            ({"weights": 40e9, "kv": 3e9}, {"weights": 52e9, "kv": 9e9}),  # more bytes added, less growth
        ),
    }
)
check_pool_tokens = _hidden(lesson11_capstone_incident.check_pool_tokens)
check_step_terms = _hidden(lesson11_capstone_incident.check_step_terms)
check_grown_term = _hidden(lesson11_capstone_incident.check_grown_term)
HELD_OUT_SEEDS = (4817, 4818, 4819)  # traces the lesson never shows, nor the docs


def check_fix(fix: object, model: Decoder | None = None) -> None:
    """The learner's fix replayed on held-out traces (the SLOs) and held-out chats on the checkpoint (the floor)."""
    lesson11_capstone_incident.check_fix(fix, model, seeds=HELD_OUT_SEEDS, reveal=False)
