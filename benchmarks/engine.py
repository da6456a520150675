"""Continuous batching on this CPU: throughput and p99 TPOT against batch and arrival rate, beside the byte model.

    python benchmarks/engine.py                  # cpu-small, max_batch 1..8, all-at-once and two Poisson rates
    python benchmarks/engine.py --quick          # a small model and trace, a smoke run
    python benchmarks/engine.py --batches 1,4,16 --rates inf,20,5 --requests 32 --threads 2

For each (max_batch, arrival rate) it plays one trace twice through ``kvlab.engine.Engine``: once on the real clock
(measured), once on a ``SimulatedClock`` that charges every model call the roofline's time, the larger of its bytes
over the read bandwidth and its FLOPs over the matmul rate, both measured here at the same thread count
(predicted). Rate ``inf`` sends every request at time 0; a finite rate draws Poisson arrivals (requests per second)
from ``--seed``, the same trace for every batch. The gap between the two columns is time the byte model leaves
out: Python and kernel launch overhead, the paged cache's gather copies, one attention call per row of a ragged
decode batch, and small matmuls running below the measured matmul rate.

A benchmark, not a test: timings on a shared machine vary. Run it on an idle one and report what it prints.
"""

from __future__ import annotations

import argparse
import math

import torch

import kvlab
from kvlab.engine import Engine, Request, RunReport, SimulatedClock
from kvlab.machine.timing import machine_info, measure_bandwidth, measure_matmul_flops
from kvlab.metrics import percentile
from kvlab.model.decoder import Decoder


def trace(n: int, prompt_len: int, new_tokens: int, rate: float, vocab: int, seed: int) -> list[Request]:
    """``n`` requests of random prompts; arrivals at ``rate`` per second (Poisson), or all at 0 for ``inf``."""
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n).exponential_(1.0, generator=gen) / rate if math.isfinite(rate) else torch.zeros(n)
    arrivals = torch.cumsum(gaps, 0).tolist()
    return [
        Request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), new_tokens, arrival_s=t)
        for t in arrivals
    ]


def p99_tpot_ms(report: RunReport) -> float:
    return percentile([r.tpot_ms for r in report.completed if r.tpot_ms is not None], 99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cpu-small", help="a runnable preset (kvlab models)")
    parser.add_argument("--batches", default="1,2,4,8", help="max_batch values, comma-separated")
    parser.add_argument("--rates", default="inf,40,10", help="arrival rates in requests/s ('inf': all at once)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the lessons use 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small model and trace: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.rates, args.requests, args.prompt, args.new_tokens = "1,4", "inf,50", 6, 16, 8
    torch.set_num_threads(args.threads)
    cfg = kvlab.get_model(args.model)
    if args.quick:
        cfg = kvlab.ModelConfig(
            n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=512, max_seq_len=256, name="quick"
        )
    model = Decoder(cfg, device="cpu")
    bandwidth = measure_bandwidth("cpu", size_mb=64 if args.quick else None)
    print(f"machine: {machine_info()}")
    flops = measure_matmul_flops("cpu")
    print(
        f"model {cfg.name}; read bandwidth {bandwidth.read_gbps:.1f} GB/s and fp32 matmul {flops / 1e9:.1f} GFLOP/s "
        f"at {bandwidth.threads} thread(s)"
    )
    per_request = args.prompt + args.new_tokens
    batches = [int(b) for b in args.batches.split(",")]
    n_blocks = max(batches) * math.ceil(per_request / args.block_size) + 1  # every batch fits: no preemption

    def play(requests: list[Request], max_batch: int, clock) -> RunReport:
        engine = Engine(model, n_blocks=n_blocks, block_size=args.block_size, max_batch=max_batch, clock=clock)
        return engine.run(requests)

    play(trace(2, args.prompt, 4, math.inf, cfg.vocab_size, args.seed + 1), 2, "real")  # warm-up, untimed
    simulated = SimulatedClock(cfg, bandwidth.read_gbps, peak_flops_per_s=flops)
    header = (
        f"{'max_batch':>9} {'rate/s':>7} | {'tok/s':>8} {'pred':>8} | {'p99 TPOT ms':>11} {'pred':>8} | {'ratio':>5}"
    )
    print(header)
    print("-" * len(header))
    for rate in (float(r) for r in args.rates.split(",")):
        requests = trace(args.requests, args.prompt, args.new_tokens, rate, cfg.vocab_size, args.seed)
        for max_batch in batches:
            measured, predicted = play(requests, max_batch, "real"), play(requests, max_batch, simulated)
            ratio = p99_tpot_ms(measured) / p99_tpot_ms(predicted)
            throughput = f"{measured.output_tokens_per_s:>8.1f} {predicted.output_tokens_per_s:>8.1f}"
            tpot = f"{p99_tpot_ms(measured):>11.2f} {p99_tpot_ms(predicted):>8.2f}"
            print(f"{max_batch:>9} {rate:>7g} | {throughput} | {tpot} | {ratio:>5.2f}")
    print("pred: the same trace on a SimulatedClock: per model call, max(bytes / read bandwidth, FLOPs / matmul rate).")
    print("ratio: measured / predicted p99 TPOT; above 1 is time the byte model does not count.")


if __name__ == "__main__":
    main()
