"""The weight term on this CPU: each kernel's pass over the weights, and the zero-context step, against bandwidth.

At 1 and 2 threads, against copy and read bandwidth and against llama.cpp's F32 figures.

    python benchmarks/weight_term.py                    # cpu-small, 1 and 2 threads
    python benchmarks/weight_term.py --threads 1 --clock thread   # one thread, CPU time only (a loaded machine)
    python benchmarks/weight_term.py --quick            # cpu-tiny, a smoke run

Everything at one thread count is measured in one loop, one call of each candidate in turn (medians), so a burst
of load from elsewhere slows each a little rather than one a lot:
1. the copy and read probes (``kvlab.machine.timing.measure_bandwidth``);
2. one pass of every projection of a step (8 layers and the head, the model's own weights, in step order) by each
   kernel: summing the same tensors (a read-only stream), torch's ``x @ W`` (MKL in torch's x86 wheels), the
   model's own product (``WeightFormat.matmul``: numpy's OpenBLAS for one row at one thread on an AMD CPU, else
   torch's), ``F.linear`` on ``[out, in]`` copies, numba's dot of each ``[out, in]`` row (what ``runtime="numba"``
   runs; ``pip install -e .[numba]``), numpy's BLAS (OpenBLAS in numpy's wheels, held to the same
   thread count through threadpoolctl), and int8 through PyTorch's dynamic quantized linear (what
   ``Decoder(weight_dtype="int8")`` runs), whose bytes are a quarter;
3. the model's zero-context decode step, against the weight bytes over the read bandwidth (predicted), and, where
   its one-row products run on OpenBLAS, the same step with them on MKL; the eager floor: the same step written as
   one flat module (``benchmarks/flat_step.py``), with no modules inside, no cache object and no checks, about as
   few PyTorch calls as eager mode allows; and, where ``onnxruntime`` and ``onnx`` are installed, each in a loop of
   its own, the model's step with ``runtime="onnx"`` and ``"onnx-packed"`` on its ``new_cache`` (one ONNX Runtime
   graph a step, attention included: ``kvlab.model.onnx_step``), with ``runtime="numba"`` where numba is installed
   (one compiled call a step: ``kvlab.model.numba_step``), and the flat module exported and run whole by ONNX
   Runtime, with its weights inside the graph, and by OpenVINO where ``openvino`` is installed (``pip install -e
   .[openvino]``): the same graph on another runtime's kernels. The gap between the model and the floor is kvlab's
   own overhead; between the floor and ONNX Runtime, PyTorch's cost per call;
4. at more than one thread, the weights the model cuts into column blocks (``kvlab.model.weights.splits_columns``):
   a pass over them by ``x @ W`` and by ``column_blocks_matmul``, at 1, 2, 4 and 8 rows.

numpy's candidate runs in a loop of its own after the others, with OpenBLAS held to one thread again at the end:
OpenBLAS keeps its threads spinning after a call, and beside torch's OpenMP team they took the second CPU from every
other two-thread measurement in the loop (docs/cpu_performance.md, section G). With several thread counts, the step
is also timed with the counts alternating from one call to the next, so that "two threads against one" compares
steps taken in the same seconds.

A benchmark, not a test: say how loaded the machine was (the script prints the load average where it can).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import threadpool_limits

from kvlab import Decoder, get_model
from kvlab.machine.timing import (
    CLOCKS,
    bandwidth_buffer_mb,
    load_average,
    machine_info,
    time_call,
    time_interleaved,
)
from kvlab.measure.step_time import layer_weights
from kvlab.model import numba_step
from kvlab.model import weights as weight_kernels
from kvlab.model.onnx_step import unsupported as onnx_unsupported
from kvlab.model.runtimes import ONNX_RUNTIMES
from kvlab.model.weights import WeightFormat, column_blocks_matmul, numpy_openblas, splits_columns
from kvlab.roofline import weight_bytes_read

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flat_step import FlatStep, check_step, floor_covers, onnx_step, openvino_step  # noqa: E402 (beside us)

# llama.cpp 0c1e570 on cpu-small converted to GGUF F32, zero-context step, 2-core AMD EPYC Zen 3
# (docs/cpu_performance.md, section A): ms at one and two threads.
LLAMA_CPP_F32_MS = {1: 6.6, 2: 5.1}

# The flat step exported to ONNX and run whole, by runtime: no Python per operation, no cache object.
WHOLE_FLAT_STEPS = {"onnxruntime": onnx_step, "openvino": openvino_step}


def matvec_candidates(model: Decoder) -> tuple[dict[str, object], dict[str, int]]:
    """One pass of a step's projections per torch kernel, and the bytes each pass reads."""
    weights = [w for layer in layer_weights(model) for w in layer]
    xs = [torch.randn(1, w.shape[0]) for w in weights]
    transposed = [w.detach().T.contiguous() for w in weights]  # nn.Linear's [out, in]
    fp32, int8 = WeightFormat("fp32"), WeightFormat("int8")

    def run(fn):
        def one_pass() -> None:
            for i in range(len(weights)):
                fn(i)

        return one_pass

    candidates = {
        "sum (read stream)": run(lambda i: weights[i].sum()),
        "torch x @ W (MKL)": run(lambda i: xs[i] @ weights[i]),
        "kvlab's product (fp32)": run(lambda i: fp32.matmul(xs[i], weights[i])),
        "F.linear [out, in]": run(lambda i: F.linear(xs[i], transposed[i])),
        "int8 dynamic linear": run(lambda i: int8.matmul(xs[i], weights[i])),
    }
    if numba_step.unsupported(model) is None:  # numba's product, as runtime="numba" runs it on [out, in] rows
        from kvlab.model import numba_kernels  # imports numba: only where it is installed

        rows, xs_np = [t.numpy() for t in transposed], [x.numpy() for x in xs]
        outs = [np.empty((1, w.shape[1]), np.float32) for w in weights]
        candidates["numba rows [out, in]"] = run(lambda i: numba_kernels.matvec(rows[i], xs_np[i], outs[i], False))
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    nbytes = dict.fromkeys(candidates, fp32_bytes)
    nbytes["int8 dynamic linear"] = sum(int8.weight_bytes(w) for w in weights)
    return candidates, nbytes


def max_logit_diff(model: Decoder, other: Decoder, tokens: list[int]) -> float:
    """Feed ``tokens`` one decode step at a time to both models, each on its own cache; the largest logit
    difference. Raises beyond 1e-4: a step is timed in the model's place only if it computes the same logits."""
    ours, theirs = model.new_cache(1, len(tokens)), other.new_cache(1, len(tokens))
    worst = 0.0
    for t in tokens:
        want, got = model.decode_step(torch.tensor([t]), ours), other.decode_step(torch.tensor([t]), theirs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        worst = max(worst, (got - want).abs().max().item())
    return worst


def on_torch_kernel(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``step`` with every product on torch's own kernel, as before one-row products moved to numpy's OpenBLAS."""

    def run() -> torch.Tensor:
        shipped = weight_kernels.runs_on_openblas
        weight_kernels.runs_on_openblas = lambda x, w: False
        try:
            return step()
        finally:
            weight_kernels.runs_on_openblas = shipped

    return run


def zero_context_step(model: Decoder) -> Callable[[], torch.Tensor]:
    """One token into an empty cache, rolled back after each step so that every call reads no K/V."""
    cache = model.new_cache(1, 16)
    token = torch.zeros(1, dtype=torch.long)

    def step() -> torch.Tensor:
        logits = model.decode_step(token, cache)
        cache.truncate(0)
        return logits

    return step


BLOCK_ROWS = (1, 2, 4, 8)


def column_blocks_by_rows(model: Decoder, threads: int, repeats: int, clock: str) -> dict:
    """ms of one pass over the weights ``splits_columns`` cuts at ``threads`` (judged at two rows), by ``x @ W`` and
    by ``column_blocks_matmul``, at each of ``BLOCK_ROWS`` rows, all in one interleaved loop."""
    weights = [
        w for layer in layer_weights(model) for w in layer if splits_columns(torch.empty(2, w.shape[0]), w, threads)
    ]
    if not weights:
        return {"mb": 0.0, "n_weights": 0, "ms": {}}
    fns = {}
    for rows in BLOCK_ROWS:
        xs = [torch.randn(rows, w.shape[0]) for w in weights]
        fns[(rows, "x @ W")] = lambda xs=xs: [x @ w for x, w in zip(xs, weights, strict=True)]
        fns[(rows, "blocks")] = lambda xs=xs: [
            column_blocks_matmul(x, w, threads) for x, w in zip(xs, weights, strict=True)
        ]
    times = time_interleaved(fns, repeats, warmup=2, clock=clock)
    ms = {
        rows: {kind: statistics.median(times[(rows, kind)]) * 1e3 for kind in ("x @ W", "blocks")}
        for rows in BLOCK_ROWS
    }
    return {"mb": sum(w.numel() * 4 for w in weights) / 1e6, "n_weights": len(weights), "ms": ms}


def numpy_pass(model: Decoder, threads: int, repeats: int, clock: str) -> dict:
    """numpy's ``x @ W`` over a step's weights with its BLAS held to ``threads`` for this loop only (then back to
    one thread, as ``main`` set it)."""
    weights = [w.detach().numpy() for layer in layer_weights(model) for w in layer]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, w.shape[0]), dtype=np.float32) for w in weights]
    outs = [np.empty((1, w.shape[1]), np.float32) for w in weights]

    def one_pass() -> None:
        for x, w, out in zip(xs, weights, outs, strict=True):
            np.matmul(x, w, out=out)

    with threadpool_limits(threads, user_api="blas"):
        (seconds,) = time_interleaved({"numpy": one_pass}, repeats, warmup=2, clock=clock).values()
    mb = sum(w.nbytes for w in weights) / 1e6
    ms = statistics.median(seconds) * 1e3
    return {"ms": ms, "mb": mb, "gbps": mb / ms}


def steps_alternating(model: Decoder, thread_counts: list[int], repeats: int) -> dict[int, float]:
    """Median ms of the zero-context step at each thread count, the counts taking turns call by call (wall clock),
    so that the comparison holds whatever else the machine did meanwhile. Each turn's first step is not timed: it
    pays for waking the other threads."""
    step = zero_context_step(model)
    times: dict[int, list[float]] = {t: [] for t in thread_counts}
    for _ in range(repeats):
        for t in thread_counts:
            torch.set_num_threads(t)
            times[t] += time_call(step, 3, warmup=1)
    return {t: statistics.median(v) * 1e3 for t, v in times.items()}


def probes(size_mb: float) -> dict[str, object]:
    n = int(size_mb * 1e6 / 4)
    src, dst = torch.empty(n).normal_(), torch.empty(n)
    return {"copy probe": lambda: dst.copy_(src), "read probe": lambda: src.sum()}


@torch.inference_mode()
def measure(
    model: Decoder, runtimes: dict[str, Decoder], threads: int, repeats: int, clock: str, size_mb: float
) -> dict:
    torch.set_num_threads(threads)
    candidates, nbytes = matvec_candidates(model)
    steps = {f"step, {model.weight_dtype}": zero_context_step(model)}
    if threads == 1 and model.weight_dtype == "fp32" and numpy_openblas() is not None:
        steps["step, fp32, MKL products"] = on_torch_kernel(steps["step, fp32"])
    flat = FlatStep(model) if floor_covers(model) else None
    if flat is not None:
        cos, sin = model.rope.span(0, 1)
        zero = (torch.zeros(1, dtype=torch.long), cos[0], sin[0], *flat.empty_cache())  # position 0, no K/V
        steps["eager floor (same step, flat)"] = lambda: flat(*zero)
    fns = probes(size_mb) | candidates | steps
    times = time_interleaved(fns, repeats, warmup=2, clock=clock)
    ms = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    buffer = int(size_mb * 1e6 / 4) * 4
    copy_gbps, read_gbps = 2 * buffer / ms["copy probe"] / 1e6, buffer / ms["read probe"] / 1e6
    matvec = {k: {"ms": ms[k], "mb": nbytes[k] / 1e6, "gbps": nbytes[k] / ms[k] / 1e6} for k in candidates}
    matvec["numpy x @ W (BLAS), own loop"] = numpy_pass(model, threads, repeats, clock)
    # ONNX Runtime's steps, each in a loop of its own. At more than one thread their sessions' threads spin within a
    # run, and next to PyTorch's OpenMP threads, which spin for a while after each of PyTorch's steps, both slowed.
    alone = {}
    for runtime, runtime_model in runtimes.items():
        alone[f"step, {runtime}, own loop"] = zero_context_step(runtime_model)
    for name, make in WHOLE_FLAT_STEPS.items():
        whole = make(flat, threads) if flat is not None else None
        if whole is not None:
            alone[f"{name}, whole flat step"] = functools.partial(whole, *zero)
    for name, fn in alone.items():
        (seconds,) = time_interleaved({name: fn}, repeats, warmup=2, clock=clock).values()
        ms[name], steps[name] = statistics.median(seconds) * 1e3, fn
    step_bytes = weight_bytes_read(model.cfg)
    blocks = column_blocks_by_rows(model, threads, repeats, clock) if threads > 1 else None
    return {
        "threads": threads,
        "column_blocks": blocks,
        "load": load_average(),
        "copy_gbps": copy_gbps,
        "read_gbps": read_gbps,
        "matvec": matvec,
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
    blocks = r["column_blocks"]
    if blocks and blocks["ms"]:
        lines.append(
            f"column blocks: a pass over the {blocks['n_weights']} weights the model splits at {t} threads "
            f"({blocks['mb']:.1f} MB)\n{'rows':>6} {'x @ W ms':>9} {'blocks ms':>10} {'blocks / x @ W':>15}"
        )
        for rows, m in blocks["ms"].items():
            lines.append(f"{rows:>6} {m['x @ W']:>9.2f} {m['blocks']:>10.2f} {m['blocks'] / m['x @ W']:>15.2f}")
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
    # kvlab's compiled steps, each on a model of its own with the same weights.
    runtimes = {}
    for runtime in (*ONNX_RUNTIMES, "numba"):
        why_not = (numba_step.unsupported if runtime == "numba" else onnx_unsupported)(model)
        if why_not is not None:
            print(f"runtime={runtime!r} skipped: {why_not}")
            continue
        runtimes[runtime] = Decoder(model.cfg, device="cpu", runtime=runtime)
        runtimes[runtime].load_state_dict(model.state_dict())
    print("environment:", json.dumps(machine_info()), "| OPENBLAS_NUM_THREADS:", os.environ.get("OPENBLAS_NUM_THREADS"))
    # Outside numpy's own loop its BLAS stays at one thread: OpenBLAS's idle threads spin, and beside torch's two
    # they took the second CPU from every other two-thread measurement.
    threadpool_limits(1, user_api="blas")
    floor_diff = None
    if floor_covers(model):
        with torch.inference_mode():
            floor_diff = check_step(model, list(range(1, 9)))
            print(f"eager floor: the model's logits over 8 steps, largest difference {floor_diff:.1e}")
            for name, make in WHOLE_FLAT_STEPS.items():
                whole = make(FlatStep(model), 1)
                if whole is not None:
                    diff = check_step(model, list(range(1, 9)), whole)
                    print(f"{name}, whole flat step: the model's logits over 8 steps, largest difference {diff:.1e}")
    for runtime, runtime_model in runtimes.items():
        with torch.inference_mode():
            runtime_diff = max_logit_diff(model, runtime_model, list(range(1, 9)))
        print(f"runtime='{runtime}': the model's logits over 8 steps, largest difference {runtime_diff:.1e}")
    size_mb = bandwidth_buffer_mb(quick=args.quick)
    results = []
    for t in thread_counts:
        results.append(measure(model, runtimes, t, args.repeats, args.clock, size_mb))
        print("\n".join(report(results[-1], args.preset)))
    print(
        "\n"
        + "\n".join(
            [
                "weight term of copy: the weight bytes over copy bandwidth, divided by the measured step (80% is the "
                "target docs/cpu_performance.md measures against).",
                "x llama.cpp F32: the step over llama.cpp's on the same model and CPU kind (target: 1.2 at most).",
                "eager floor: the same step with kvlab's modules, cache object and checks taken out (FlatStep); what "
                "is left above the weight bytes is PyTorch's cost per call.",
                "runtime='onnx': kvlab's step under Decoder(cfg, runtime='onnx') on the model's own new_cache (one "
                "ONNX Runtime graph a step, attention included, on torch's thread count), timed in a loop of its own; "
                "'onnx-packed': the same graph holding a copy of the weights repacked by ONNX Runtime; 'numba': the "
                "whole step as one call compiled by numba, on one thread, its weights a transposed copy read row by "
                "row (the 'numba rows [out, in]' pass).",
                "onnxruntime, whole flat step: the flat step exported to ONNX and run by ONNX Runtime's C++ executor "
                "(timed in a loop of its own), with no Python per operation and no cache object: a ceiling; "
                "openvino: the same graph compiled by OpenVINO in fp32, on its own kernels.",
            ]
        )
    )
    alternating = None
    if len(thread_counts) > 1 and args.clock == "wall":
        with torch.inference_mode():
            alternating = {"eager": steps_alternating(model, thread_counts, args.repeats)}
            for runtime, runtime_model in runtimes.items():
                alternating[runtime] = steps_alternating(runtime_model, thread_counts, args.repeats)
        for runtime, by_threads in alternating.items():
            print(
                f"zero-context step, runtime {runtime}, thread counts alternating call by call: "
                + ", ".join(f"{ms:.2f} ms at {t} thread(s)" for t, ms in by_threads.items())
            )
    if args.json:
        result = {"environment": machine_info(), "preset": args.preset, "results": results}
        result |= {"alternating_ms": alternating, "floor_max_logit_diff": floor_diff}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
