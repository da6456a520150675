"""How closely does measured TPOT follow bytes / bandwidth on this machine, and how does kvlab compare to its peer?

    python benchmarks/fidelity.py                 # cpu-small, contexts 2k..32k, plus the transformers comparison
    python benchmarks/fidelity.py --quick         # small sizes, a smoke run
    python benchmarks/fidelity.py --threads 1     # what a learner's one-thread lesson sees
    python benchmarks/fidelity.py --runtime onnx  # the step's dense parts in ONNX Runtime (pip install -e .[onnx])
    python benchmarks/fidelity.py --json out.json --plot out.png

Prints three things, each measured in this one process:
1. the machine's copy and read bandwidth, with torch's thread count (and at one thread, where that differs);
2. TPOT against context: the line fit (R^2), and the share of the measured read bandwidth that the weight term
   (intercept) and the KV term (slope) each reach. Read, not copy: a decode step reads its bytes and writes
   almost nothing, and a copy's figure counts each byte twice. On the AMD machine in docs/cpu_performance.md the
   weight matvecs (``x @ W`` with one row) ran on one thread however many torch was granted, so the weight term
   is also set against the one-thread read bandwidth;
3. kvlab's decode step against Hugging Face transformers' at the same weights and context, with transformers'
   preallocated ``StaticCache`` and its default ``DynamicCache``, alternating step by step so that both see the
   same machine state.

A benchmark, not a test: timings on a shared machine vary. Run it on an idle one and report what it prints.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import warnings

import torch

from kvlab import Decoder, get_model
from kvlab.cli import parse_tokens
from kvlab.machine.timing import Bandwidth, bandwidth_buffer_mb, machine_info, measure_bandwidth, time_interleaved
from kvlab.measure.sweep import sweep_context
from kvlab.model.runtimes import RUNTIMES
from kvlab.roofline import predict_tpot_ms


def compare_with_transformers(model: Decoder, context: int, steps: int) -> dict[str, float]:
    """Median ms per decode step at ``context`` for kvlab, HF StaticCache and HF DynamicCache, interleaved."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import DynamicCache, StaticCache

    # transformers 5.x renames past_key_values; the old name still works and is what 4.x understands.
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)

    from kvlab.model.hf import to_hf

    hf = to_hf(model)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, context - 1), generator=torch.Generator().manual_seed(0))
    total = context + steps + 2
    ours = model.new_cache(1, total)
    static = StaticCache(config=hf.config, max_cache_len=total)
    dynamic = DynamicCache(config=hf.config)
    with torch.inference_mode():
        model.prefill(prompt, ours)
        for cache in (static, dynamic):
            hf(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(context - 1))

        def kvlab_step() -> None:
            model.decode_step(torch.zeros(1, dtype=torch.long), ours)

        def hf_step(cache):
            positions = itertools.count(context - 1)

            def step() -> None:
                pos = torch.tensor([next(positions)])
                hf(
                    input_ids=torch.zeros(1, 1, dtype=torch.long),
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=pos,
                )

            return step

        runners = {"kvlab": kvlab_step, "hf_static": hf_step(static), "hf_dynamic": hf_step(dynamic)}
        times = time_interleaved(runners, steps, warmup=2, device=model.device)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def one_thread_bandwidth(device: torch.device, size_mb: float) -> Bandwidth:
    """The bandwidth one thread reaches, measured with torch held to one thread and then restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_bandwidth(device, size_mb=size_mb)
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--contexts", default="2k,4k,8k,12k,16k,24k,32k")
    parser.add_argument("--peer-contexts", default="8k,32k", help="contexts for the transformers comparison")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--peer-steps", type=int, default=10)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own count)")
    parser.add_argument(
        "--runtime", default="eager", choices=RUNTIMES, help="what runs the decode step (Decoder's runtime)"
    )
    parser.add_argument("--quick", action="store_true", help="cpu-tiny, short contexts")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.contexts, args.peer_contexts, args.peer_steps = "cpu-tiny", "256,512,1k,2k", "1k", 4

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads}; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    contexts = [parse_tokens(c) for c in args.contexts.split(",")]
    peer_contexts = [parse_tokens(c) for c in args.peer_contexts.split(",") if c]
    cfg = get_model(args.preset)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, max(contexts + peer_contexts) + 64))
    model = Decoder(cfg, device=args.device, runtime=args.runtime)
    print("environment:", json.dumps(machine_info()), "| runtime:", model.runtime)

    size_mb = bandwidth_buffer_mb(quick=args.quick)
    bw = measure_bandwidth(model.device, size_mb=size_mb)
    bandwidths = [bw]
    if model.device.type == "cpu" and torch.get_num_threads() > 1:
        bandwidths.append(one_thread_bandwidth(model.device, size_mb))
    for b in bandwidths:
        label = f"{b.threads} thread(s)" if b.threads else b.device
        print(
            f"bandwidth, {label}: copy {b.copy_gbps:.1f} GB/s (best {b.copy_best_gbps:.1f}), "
            f"read {b.read_gbps:.1f} GB/s (best {b.read_best_gbps:.1f}), {b.size_mb:.0f} MB buffers"
        )

    sweep = sweep_context(
        model, contexts, n_tokens=args.tokens, n_requests=args.requests, batch=args.batch, bandwidth=bw
    )
    print(
        f"\n{cfg.name}, batch {args.batch}, runtime {model.runtime}: TPOT against context "
        f"(median of {args.requests} requests)"
    )
    print(f"{'context':>8} {'TPOT ms':>9} {'p99 ms':>8} {'predicted':>10} {'ratio':>6}")
    for p in sweep.points:
        m = p.metrics()
        print(
            f"{p.context:>8} {p.tpot_ms:>9.2f} {m['p99_tpot_ms']:>8.2f} {p.predicted_tpot_ms:>10.2f} "
            f"{p.predicted_tpot_ms / p.tpot_ms:>6.2f}"
        )
    s = sweep.summary()
    print(
        f"fit: slope {s['slope_us_per_token']:.3f} us/token (predicted {s['predicted_slope_us_per_token']:.3f}), "
        f"intercept {s['intercept_ms']:.2f} ms (predicted {s['predicted_intercept_ms']:.2f}), R^2 = {s['r2']:.4f}"
    )
    print(
        f"share of read bandwidth reached: weight term {s['weight_bandwidth_fraction']:.0%}, "
        f"KV term {s['kv_bandwidth_fraction']:.0%}"
    )
    if len(bandwidths) > 1:
        one = predict_tpot_ms(sweep.weight_bytes_read, bandwidths[1].read_gbps)
        print(f"weight term against one thread's read bandwidth: predicted {one:.2f} ms, {one / s['intercept_ms']:.0%}")

    peer = {}
    if peer_contexts:
        print(f"\nkvlab vs transformers at the same weights, interleaved, median of {args.peer_steps} steps (ms)")
        print(f"{'context':>8} {'kvlab':>8} {'HF static':>10} {'HF dynamic':>11}")
        for context in peer_contexts:
            peer[context] = compare_with_transformers(model, context, args.peer_steps)
            r = peer[context]
            print(f"{context:>8} {r['kvlab']:>8.2f} {r['hf_static']:>10.2f} {r['hf_dynamic']:>11.2f}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(sweep.to_dict() | {"transformers": peer}, f, indent=2)
    if args.plot:
        sweep.plot(args.plot)


if __name__ == "__main__":
    main()
