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

__all__ = [
    "AB_MIN_RATIO",
    "COPY_BAND",
    "SLOPE_BAND",
    "check_ab_slopes",
    "check_achieved_fraction",
    "check_batch_for_tpot",
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
    "check_measured_copy",
    "check_percentile",
    "check_prefill_flops",
    "check_quick_mode",
    "check_request_metrics",
    "check_ridge_intensity",
    "check_roofline_time_ms",
    "check_slope_band",
    "check_stream_ms",
    "check_tpot_ms",
    "check_weight_bytes",
    "quick_mode",
    "setup_lesson",
]
