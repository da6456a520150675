"""Lesson 11's incident, every lever: P99 TPOT and TTFT at scale (pooled over traces), quality on the checkpoint.

    python benchmarks/incident.py                   # the lesson's traces (PUBLIC_SEEDS)
    python benchmarks/incident.py --seeds 3,4,5      # traces the lesson does not explore

The at-scale half is the engine's simulated clock (``kvlab.course.incident``), so it prints the same numbers on any
machine; the quality half runs the checkpoint on this CPU (greedy, so the same numbers up to a near-tie), and
the wall times of both depend on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvlab.course.incident import INCIDENT, PUBLIC_SEEDS, Fix
from kvlab.model.pretrained import load_pretrained

FIXES = (
    Fix(),
    Fix(prefix_caching=False),
    Fix(prefix_caching=False, kv_dtype="int4"),
    Fix(kv_dtype="fp8"),
    Fix(kv_dtype="int8"),
    Fix(kv_dtype="int4"),
    Fix(window=4096, sinks=4),
    Fix(window=8192, sinks=4),
    Fix(window=16384, sinks=4),
    Fix(kv_dtype="fp8", window=16384, sinks=4),
    Fix(session_cap=16384),
    Fix(kv_dtype="int4", session_cap=24000),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=",".join(map(str, PUBLIC_SEEDS)), help="comma-separated trace seeds")
    seeds = tuple(int(s) for s in parser.parse_args().seeds.split(","))
    torch.set_num_threads(1)
    model = load_pretrained(INCIDENT.checkpoint, device="cpu")
    print(
        f"{INCIDENT.model} on {INCIDENT.gpu}, seeds {seeds}; SLOs P99 TPOT <= {INCIDENT.slo_p99_tpot_ms} ms, P99 "
        f"TTFT <= {INCIDENT.slo_p99_ttft_ms:.0f} ms; floor recall >= {INCIDENT.recall_floor}, ppl <= "
        f"{1 + INCIDENT.ppl_tolerance} x full ({INCIDENT.checkpoint}, quality on seed {seeds[0]})"
    )
    print(f"{'fix':58s} {'P99 TPOT':>9} {'P99 TTFT':>9} {'recall':>7} {'ppl x':>7}  verdict  wall")
    for fix in FIXES:
        started = time.perf_counter()
        v = INCIDENT.judge(fix, seeds, model)
        verdict = "PASS" if v.passed else ("slo" if not v.slo_met else "") + (" floor" if not v.quality_met else "")
        print(
            f"{fix.describe():58s} {v.p99_tpot_ms:9.2f} {v.p99_ttft_ms:9.0f} {v.quality.recall:7.2f} "
            f"{v.quality.ppl_ratio:7.4f}  {verdict:7s} {time.perf_counter() - started:4.1f} s"
        )


if __name__ == "__main__":
    main()
