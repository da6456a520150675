"""The course's checkers, as the notebooks import them: ``from kvlab.checks import check_kv_bytes_per_token``.

Call one on your answer: it is silent when the answer is right, and raises ``AssertionError`` saying what to fix
when it is not. Each lives in its lesson's module under ``kvlab.course`` (with the cases it tries and, for a
measured quantity, the band it accepts and the measurements that band was set from); the helpers they share
(quick mode, the lesson setup, the messages) are in ``kvlab.course.grading``. New code imports from there.
"""

from __future__ import annotations

from kvlab.course.grading import quick_mode, setup_lesson
from kvlab.course.lesson00_orientation import (
    COPY_BAND,
    check_copy_gbps,
    check_environment_report,
    check_measured_copy,
    check_quick_mode,
    check_stream_ms,
)
from kvlab.course.lesson01_bytes_per_step import (
    check_batch_for_tpot,
    check_decode_attention_flops,
    check_error_audit,
    check_kv_bytes_per_token,
    check_tpot_ms,
    check_weight_bytes,
)
from kvlab.course.lesson02_roofline import (
    check_achieved_fraction,
    check_decode_flops,
    check_fixed_overhead,
    check_prefill_flops,
    check_ridge_intensity,
    check_roofline_time_ms,
)
from kvlab.course.lesson03_measuring_tpot import (
    AB_MIN_RATIO,
    SLOPE_BAND,
    check_ab_slopes,
    check_concat_cache,
    check_crossover_context,
    check_fit_tpot,
    check_percentile,
    check_request_metrics,
    check_slope_band,
)
from kvlab.course.lesson04_batching import (
    KV_RATIO_BAND,
    WEIGHT_RATIO_BAND,
    check_allocation_waste,
    check_batch_ratios,
    check_max_batch_for_memory,
    check_max_batch_in_pool,
    check_step_bytes,
    check_throughput_latency,
)
from kvlab.course.lesson05_prefix_caching import (
    CASCADE_MAX_RATIO,
    TPOT_BAND,
    TTFT_MIN_TRACKING,
    check_block_hashes,
    check_blocks_needed,
    check_cascade_bytes,
    check_cascade_slopes,
    check_prefix_hit_tokens,
    check_tpot_after_hit,
    check_ttft_saved,
    check_turn_hits,
)
from kvlab.course.lesson06_gqa_mqa_mla import (
    ABSORBED_MAX_SHARE,
    LAYOUT_MAX_RATIO,
    LAYOUT_MIN_OF_BYTES,
    check_absorbed_intensity,
    check_absorbed_share,
    check_absorbed_step,
    check_layout_ratios,
    check_mla_kv_bytes,
    check_predict_layouts,
    check_query_side,
    check_split_slope,
)

__all__ = [
    "ABSORBED_MAX_SHARE",
    "AB_MIN_RATIO",
    "CASCADE_MAX_RATIO",
    "COPY_BAND",
    "KV_RATIO_BAND",
    "LAYOUT_MAX_RATIO",
    "LAYOUT_MIN_OF_BYTES",
    "SLOPE_BAND",
    "TPOT_BAND",
    "TTFT_MIN_TRACKING",
    "WEIGHT_RATIO_BAND",
    "check_ab_slopes",
    "check_absorbed_intensity",
    "check_absorbed_share",
    "check_absorbed_step",
    "check_achieved_fraction",
    "check_allocation_waste",
    "check_batch_for_tpot",
    "check_batch_ratios",
    "check_block_hashes",
    "check_blocks_needed",
    "check_cascade_bytes",
    "check_cascade_slopes",
    "check_concat_cache",
    "check_copy_gbps",
    "check_crossover_context",
    "check_decode_attention_flops",
    "check_decode_flops",
    "check_environment_report",
    "check_error_audit",
    "check_fit_tpot",
    "check_fixed_overhead",
    "check_kv_bytes_per_token",
    "check_layout_ratios",
    "check_max_batch_for_memory",
    "check_max_batch_in_pool",
    "check_measured_copy",
    "check_mla_kv_bytes",
    "check_percentile",
    "check_predict_layouts",
    "check_prefill_flops",
    "check_prefix_hit_tokens",
    "check_query_side",
    "check_quick_mode",
    "check_request_metrics",
    "check_ridge_intensity",
    "check_roofline_time_ms",
    "check_slope_band",
    "check_split_slope",
    "check_step_bytes",
    "check_stream_ms",
    "check_throughput_latency",
    "check_tpot_after_hit",
    "check_tpot_ms",
    "check_ttft_saved",
    "check_turn_hits",
    "check_weight_bytes",
    "quick_mode",
    "setup_lesson",
]
