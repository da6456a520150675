"""Where one decode step's time goes, from the command line (``kvlab.measure.step_time`` holds the measurement).

    python benchmarks/decode_breakdown.py                       # cpu-small, context 2048, torch's thread count
    python benchmarks/decode_breakdown.py --threads 1 --context 16
    python benchmarks/decode_breakdown.py --threads 1 --clock thread   # CPU time only: steadier on a loaded machine
    python benchmarks/decode_breakdown.py --json out.json

A benchmark, not a test: say how loaded the machine was.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvlab import Decoder, get_model
from kvlab.cli import parse_tokens
from kvlab.machine.timing import CLOCKS, machine_info
from kvlab.measure.step_time import breakdown, breakdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--context", default="2k", help="tokens already in the cache")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's current count)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--clock", default="wall", choices=sorted(CLOCKS), help="thread: CPU time of this thread (1 thread only)"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads}; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats: {args.repeats}; allowed: an integer >= 1")
    context = parse_tokens(args.context, "--context")
    cfg = get_model(args.preset)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, context + args.repeats + 8))
    model = Decoder(cfg, device="cpu")
    print("environment:", json.dumps(machine_info()))
    result = breakdown(model, context, args.repeats, args.clock)
    print(
        f"{cfg.name}, context {context}..{result['context_end']}, {torch.get_num_threads()} thread(s), "
        f"median of {args.repeats}, {args.clock} clock; read {result['read_gbps']:.1f} GB/s, "
        f"copy {result['copy_gbps']:.1f} GB/s ({result['buffer_mb']:.0f} MB buffers)"
    )
    print("stream: the same tensors summed read-only; predicted: MB / read bandwidth; x pred: measured / predicted")
    print("\n".join(breakdown_table(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": machine_info(), **result}, f, indent=2)


if __name__ == "__main__":
    main()
