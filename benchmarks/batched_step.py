"""The batched decode step on this CPU against two predictions: the byte model, and a roofline whose FLOP ceiling is
measured on the skinny products the step really runs (issue 29, section 3).

    python benchmarks/batched_step.py                       # cpu-small, batch 1 2 4 8 at context 512, one thread
    python benchmarks/batched_step.py --clock thread        # CPU time only, for a loaded machine (one thread)
    python benchmarks/batched_step.py --quick               # cpu-tiny, a smoke run
    python benchmarks/batched_step.py --runtime numba       # the step compiled by numba (pip install -e .[numba])

A step over B sequences reads each weight once and multiplies it by B rows, so its products do 2 B FLOPs per
weight (B/2 FLOPs per fp32 byte). A roofline drawn with a square matmul's FLOP rate puts the ridge far above the
batches a CPU serves; the products a step runs are B x d_model times d_model x N, and MKL runs those well below
the square rate. So, for each batch B, everything in one interleaved loop (medians, ``kvlab.machine.timing``):
1. the model's decode step over B sequences of ``--context`` tokens;
2. one pass of the step's products over its own weights, B rows each (what the weights cost, read from memory);
3. each distinct product shape at B rows, repeated on one weight of that shape, which stays in the CPU's caches
   where it fits: its FLOP rate with memory mostly out of the way (``skinny GFLOP/s``);
4. the read bandwidth probe, and once, the square matmul rate (``kvlab.machine.timing.measure_matmul_flops``).

Predicted, per B (KV bytes over the read bandwidth added to each, for attention):
- bytes: the weight bytes a step reads over the read bandwidth (``kvlab.roofline``), what ``kvlab predict`` says;
- roofline, square: the larger of the step's bytes over bandwidth and its FLOPs over the square rate;
- roofline, skinny: per product, the larger of its bytes over bandwidth and its FLOPs over that shape's skinny
  rate at B, summed.

What neither prediction holds is the step minus the pass of products and attention's bytes over the bandwidth:
attention's time beyond its bytes, and the fixed cost of norms, RoPE, the cache and Python (``rest``).

A benchmark, not a test: say how loaded the machine was (the script prints the load average).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Callable

import torch

from kvlab import Decoder, get_model
from kvlab.machine.timing import (
    CLOCKS,
    bandwidth_buffer_mb,
    load_average,
    machine_info,
    measure_matmul_flops,
    time_interleaved,
)
from kvlab.measure.step_time import layer_weights
from kvlab.model.runtimes import RUNTIMES
from kvlab.roofline import decode_flops, kv_bytes_per_step, roofline_time_ms, weight_bytes_read

SKINNY_REPEATS = 8  # products per timed call of a cache-resident weight: one is too short for the clock


def step_fn(model: Decoder, batch: int, context: int) -> Callable[[], object]:
    """One decode step of ``batch`` sequences, each at ``context`` cached tokens (rolled back after every step)."""
    cache = model.new_cache(batch, context + 1)
    cache.fast_fill(context, generator=torch.Generator().manual_seed(0))
    tokens = torch.zeros(batch, dtype=torch.long)

    def step() -> object:
        cache.truncate(context)
        return model.decode_step(tokens, cache)

    return step


def products_fn(weights: list[torch.Tensor], batch: int) -> Callable[[], None]:
    """One pass of the step's products: ``batch`` rows times each weight, in step order."""
    xs = [torch.randn(batch, w.shape[0]) for w in weights]

    def run() -> None:
        for x, w in zip(xs, weights, strict=True):
            x @ w

    return run


def skinny_fn(shape: tuple[int, int], batch: int) -> Callable[[], None]:
    """``SKINNY_REPEATS`` products of ``batch`` rows by one ``[in, out]`` weight, kept hot in the caches."""
    x, w = torch.randn(batch, shape[0]), torch.randn(*shape)

    def run() -> None:
        for _ in range(SKINNY_REPEATS):
            x @ w

    return run


def read_probe(size_mb: float) -> Callable[[], object]:
    src = torch.empty(int(size_mb * 1e6 / 4)).normal_()
    return src.sum


@torch.inference_mode()
def measure(model: Decoder, batches: list[int], context: int, repeats: int, clock: str, size_mb: float) -> dict:
    weights = [w.detach() for layer in layer_weights(model) for w in layer]
    shapes = Counter(tuple(w.shape) for w in weights)  # product shape -> how many a step runs
    fns: dict[tuple, Callable[[], object]] = {("read",): read_probe(size_mb)}
    for b in batches:
        fns[("step", b)] = step_fn(model, b, context)
        fns[("products", b)] = products_fn(weights, b)
        for shape in shapes:
            fns[("skinny", b, shape)] = skinny_fn(shape, b)
    times = time_interleaved(fns, repeats, warmup=2, clock=clock)
    s = {k: statistics.median(t) for k, t in times.items()}
    read_gbps = size_mb * 1e6 / s[("read",)] / 1e9
    square = measure_matmul_flops("cpu")
    cfg, rows = model.cfg, []
    for b in batches:
        kv_ms = kv_bytes_per_step(cfg, context, b) / read_gbps / 1e6
        skinny = {shape: 2 * b * shape[0] * shape[1] * SKINNY_REPEATS / s[("skinny", b, shape)] for shape in shapes}
        products_skinny_ms = 1e3 * sum(
            n * max(4 * shape[0] * shape[1] / (read_gbps * 1e9), 2 * b * shape[0] * shape[1] / skinny[shape])
            for shape, n in shapes.items()
        )
        weights_bytes = weight_bytes_read(cfg, batch=b)
        step_bytes = weights_bytes + kv_bytes_per_step(cfg, context, b)
        rows.append(
            {
                "batch": b,
                "step_ms": s[("step", b)] * 1e3,
                "products_ms": s[("products", b)] * 1e3,
                "bytes_ms": step_bytes / read_gbps / 1e6,
                "roofline_square_ms": roofline_time_ms(decode_flops(cfg, context, b), step_bytes, square, read_gbps),
                "roofline_skinny_ms": products_skinny_ms + kv_ms,
                "products_skinny_ms": products_skinny_ms,
                "skinny_gflops": {f"{i}x{o}": f / 1e9 for (i, o), f in skinny.items()},
                "rest_ms": (s[("step", b)] - s[("products", b)]) * 1e3 - kv_ms,
            }
        )
    return {"load": load_average(), "read_gbps": read_gbps, "square_gflops": square / 1e9, "rows": rows}


def report(r: dict, context: int) -> list[str]:
    lines = [
        f"load average {r['load']}: read {r['read_gbps']:.1f} GB/s, square fp32 matmul {r['square_gflops']:.0f} "
        f"GFLOP/s; context {context} per sequence",
        f"{'B':>3} {'step ms':>8} {'bytes':>7} {'roof sq':>8} {'roof sk':>8} {'step/':>6} {'step/':>6} "
        f"{'products':>9} {'pred':>6} {'rest':>6}  skinny GFLOP/s per [in x out]",
        f"{'':>3} {'':>8} {'pred':>7} {'pred':>8} {'pred':>8} {'bytes':>6} {'sk':>6} {'ms':>9} {'sk ms':>6} {'ms':>6}",
    ]
    for row in r["rows"]:
        rates = " ".join(f"{k} {v:.0f}" for k, v in row["skinny_gflops"].items())
        lines.append(
            f"{row['batch']:>3} {row['step_ms']:>8.2f} {row['bytes_ms']:>7.2f} {row['roofline_square_ms']:>8.2f} "
            f"{row['roofline_skinny_ms']:>8.2f} {row['step_ms'] / row['bytes_ms']:>6.2f} "
            f"{row['step_ms'] / row['roofline_skinny_ms']:>6.2f} {row['products_ms']:>9.2f} "
            f"{row['products_skinny_ms']:>6.2f} {row['rest_ms']:>6.2f}  {rates}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="thread: CPU time (1 thread only)")
    parser.add_argument("--quick", action="store_true", help="cpu-tiny, few repeats: a smoke run")
    parser.add_argument("--runtime", default="eager", choices=RUNTIMES, help="what runs the step (Decoder's runtime)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.repeats, args.context = "cpu-tiny", 3, 64
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches):
        raise ValueError(f"--batches: {args.batches}; allowed: integers >= 1")
    if args.context < 1:
        raise ValueError(f"--context: {args.context}; allowed: an integer >= 1")
    if args.clock == "thread" and args.threads != 1:
        raise ValueError(f"--clock thread with --threads {args.threads}; allowed: --threads 1 (it counts one thread)")
    torch.set_num_threads(args.threads)
    model = Decoder(get_model(args.preset), device="cpu", runtime=args.runtime)
    print("environment:", json.dumps(machine_info()), "| runtime:", model.runtime)
    r = measure(model, batches, args.context, args.repeats, args.clock, bandwidth_buffer_mb(quick=args.quick))
    print("\n".join(report(r, args.context)))
    print(
        "\nbytes pred: weight and KV bytes over the read bandwidth. roof sq / roof sk: the roofline with the square"
        " matmul's FLOP rate / with each product's skinny rate at B. step/bytes, step/sk: measured over those."
        "\nproducts ms: the step's products alone, over its own weights; pred sk ms: their skinny roofline. rest:"
        " step - products - KV bytes over bandwidth (attention beyond its bytes; norms, RoPE, the cache, Python)."
    )
    if args.json:
        with open(args.json, "w") as f:
            saved = {"environment": machine_info(), "preset": args.preset, "context": args.context}
            json.dump(saved | {"runtime": model.runtime, **r}, f, indent=2)


if __name__ == "__main__":
    main()
