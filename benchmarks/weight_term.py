"""The weight term on this CPU: how fast each matvec kernel reads the weights, and the zero-context step, at 1 and 2
threads, against copy and read bandwidth and against llama.cpp's F32 figures.

    python benchmarks/weight_term.py                    # cpu-small, 1 and 2 threads
    python benchmarks/weight_term.py --threads 1 --clock thread   # one thread, CPU time only (a loaded machine)
    python benchmarks/weight_term.py --quick            # cpu-tiny, a smoke run

Everything at one thread count is measured in one loop, one call of each candidate in turn (medians), so a burst
of load from elsewhere slows each a little rather than one a lot:
1. the copy and read probes (``kvlab.machine.timing.measure_bandwidth``);
2. one pass of every projection of a step (8 layers and the head, the model's own weights, in step order) by each
   kernel: summing the same tensors (a read-only stream), torch's ``x @ W`` (MKL in torch's x86 wheels),
   ``F.linear`` on ``[out, in]`` copies, numpy's BLAS (OpenBLAS in numpy's wheels, held to the same thread count
   through threadpoolctl, when it is installed), and int8 through PyTorch's dynamic quantized linear (what
   ``Decoder(weight_dtype="int8")`` runs), whose bytes are a quarter;
3. the model's zero-context decode step, against the weight bytes over the read bandwidth (predicted).

A benchmark, not a test: say how loaded the machine was (the script prints the load average where it can).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from kvlab import Decoder, get_model
from kvlab.machine.timing import CLOCKS, bandwidth_buffer_mb, load_average, machine_info, time_interleaved
from kvlab.measure.step_time import layer_weights
from kvlab.model.weights import WeightFormat
from kvlab.roofline import weight_bytes_read

# llama.cpp 0c1e570 on cpu-small converted to GGUF F32, zero-context step, 2-core AMD EPYC Zen 3
# (docs/cpu_performance.md, section A): ms at one and two threads.
LLAMA_CPP_F32_MS = {1: 6.6, 2: 5.1}


def matvec_candidates(model: Decoder, threads: int) -> tuple[dict[str, object], dict[str, int]]:
    """One pass of a step's projections per candidate kernel, and the bytes each pass reads."""
    weights = [w for layer in layer_weights(model) for w in layer]
    xs = [torch.randn(1, w.shape[0]) for w in weights]
    transposed = [w.detach().T.contiguous() for w in weights]  # nn.Linear's [out, in]
    int8 = WeightFormat("int8")
    numpy_matmul = numpy_candidate(weights, xs, threads)

    def run(fn):
        def one_pass() -> None:
            for i in range(len(weights)):
                fn(i)

        return one_pass

    candidates = {
        "sum (read stream)": run(lambda i: weights[i].sum()),
        "torch x @ W (MKL)": run(lambda i: xs[i] @ weights[i]),
        "F.linear [out, in]": run(lambda i: F.linear(xs[i], transposed[i])),
        "int8 dynamic linear": run(lambda i: int8.matmul(xs[i], weights[i])),
    }
    if numpy_matmul is not None:
        candidates["numpy x @ W (BLAS)"] = run(numpy_matmul)
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    nbytes = dict.fromkeys(candidates, fp32_bytes)
    nbytes["int8 dynamic linear"] = sum(int8.weight_bytes(w) for w in weights)
    return candidates, nbytes


def step_candidates(model: Decoder, repeats: int) -> dict[str, object]:
    """The model's zero-context decode step (one token into an empty cache, over and over)."""
    cache = model.new_cache(1, 2 * repeats + 16)
    token = torch.zeros(1, dtype=torch.long)
    return {f"step, {model.weight_dtype}": lambda: model.decode_step(token, cache)}


def numpy_candidate(weights: list[torch.Tensor], xs: list[torch.Tensor], threads: int):
    """numpy's ``x @ W`` over the same weights with its BLAS held to ``threads``, or None without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print("numpy candidate skipped: pip install threadpoolctl to hold numpy's BLAS to a thread count")
        return None
    threadpool_limits(threads, user_api="blas")
    wn, xn = [w.detach().numpy() for w in weights], [x.numpy() for x in xs]
    outs = [np.empty((1, w.shape[1]), np.float32) for w in wn]
    return lambda i: np.matmul(xn[i], wn[i], out=outs[i])


def probes(size_mb: float) -> dict[str, object]:
    n = int(size_mb * 1e6 / 4)
    src, dst = torch.empty(n).normal_(), torch.empty(n)
    return {"copy probe": lambda: dst.copy_(src), "read probe": lambda: src.sum()}


@torch.inference_mode()
def measure(model: Decoder, threads: int, repeats: int, clock: str, size_mb: float) -> dict:
    torch.set_num_threads(threads)
    candidates, nbytes = matvec_candidates(model, threads)
    steps = step_candidates(model, repeats)
    fns = probes(size_mb) | candidates | steps
    times = time_interleaved(fns, repeats, warmup=2, clock=clock)
    ms = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    buffer = int(size_mb * 1e6 / 4) * 4
    copy_gbps, read_gbps = 2 * buffer / ms["copy probe"] / 1e6, buffer / ms["read probe"] / 1e6
    step_bytes = weight_bytes_read(model.cfg)
    return {
        "threads": threads,
        "load": load_average(),
        "copy_gbps": copy_gbps,
        "read_gbps": read_gbps,
        "matvec": {k: {"ms": ms[k], "mb": nbytes[k] / 1e6, "gbps": nbytes[k] / ms[k] / 1e6} for k in candidates},
        "step": {k: ms[k] for k in steps},
        "step_weight_mb": step_bytes / 1e6,
        "predicted_read_ms": step_bytes / read_gbps / 1e6,
        "predicted_copy_ms": step_bytes / copy_gbps / 1e6,
    }


def report(r: dict, preset: str) -> list[str]:
    t = r["threads"]
    lines = [
        f"\n== {t} thread(s), load average {r['load']}: copy {r['copy_gbps']:.1f} GB/s, read {r['read_gbps']:.1f} GB/s",
        f"{'matvec pass (8 layers + head)':<30} {'MB':>6} {'ms':>7} {'GB/s':>6} {'of copy':>8} {'of read':>8}",
    ]
    for name, m in r["matvec"].items():
        lines.append(
            f"{name:<30} {m['mb']:>6.1f} {m['ms']:>7.2f} {m['gbps']:>6.1f} "
            f"{m['gbps'] / r['copy_gbps']:>8.0%} {m['gbps'] / r['read_gbps']:>8.0%}"
        )
    lines.append(
        f"{'zero-context step':<30} {'ms':>7} {'pred(read)':>10} {'weight term of copy':>20} {'x llama.cpp F32':>16}"
    )
    for name, ms in r["step"].items():
        share = r["predicted_copy_ms"] / ms
        llama = LLAMA_CPP_F32_MS.get(t) if preset == "cpu-small" else None
        vs = f"{ms / llama:>16.2f}" if llama else f"{'n/a':>16}"
        lines.append(f"{name:<30} {ms:>7.2f} {r['predicted_read_ms']:>10.2f} {share:>20.0%} {vs}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="thread: CPU time (1 thread only)")
    parser.add_argument("--quick", action="store_true", help="cpu-tiny, few repeats: a smoke run")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.repeats = "cpu-tiny", 5
    thread_counts = [int(t) for t in args.threads.split(",")]
    if any(t < 1 for t in thread_counts):
        raise ValueError(f"--threads: {args.threads}; allowed: integers >= 1")
    if args.clock == "thread" and thread_counts != [1]:
        raise ValueError(f"--clock thread with --threads {args.threads}; allowed: --threads 1 (it counts one thread)")
    model = Decoder(get_model(args.preset), device="cpu")
    print("environment:", json.dumps(machine_info()), "| OPENBLAS_NUM_THREADS:", os.environ.get("OPENBLAS_NUM_THREADS"))
    size_mb = bandwidth_buffer_mb(quick=args.quick)
    results = []
    for t in thread_counts:
        results.append(measure(model, t, args.repeats, args.clock, size_mb))
        print("\n".join(report(results[-1], args.preset)))
    print(
        "\nweight term of copy: the weight bytes over copy bandwidth, divided by the measured step (the issue's "
        "measure; the target is 80%).\nx llama.cpp F32: the step over llama.cpp's on the same model and CPU kind "
        "(target: 1.2 at most)."
    )
    if len(results) == 2:
        one, two = (min(r["step"].values()) for r in results)
        print(f"fastest step: {one:.2f} ms at {thread_counts[0]} thread(s), {two:.2f} ms at {thread_counts[1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": machine_info(), "preset": args.preset, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
