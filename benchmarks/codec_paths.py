"""Time decode attention over a quantized KV cache: does reading fewer bytes make a CPU step faster?

For each context length and each path, a cpu-small-shaped cache (8 layers, 8 KV heads of 64, batch 1) is filled
with random K/V, then decode steps are timed one by one. A step is what ``Decoder.decode_step`` asks of its cache:
``reserve(1)``, then ``append`` and ``attend`` for every layer (the projections and MLP are left out, so the
time is the KV cache's alone). Reported: the median ms per step (and the 10th-90th percentile range), the K/V
bytes the step moves by the cache's own count (``bytes_read_per_step``), and their ratio in GB/s.

Between steps the script streams ``--flush-mb`` of unrelated memory, as a real step's weights would, so a cache
small enough to sit in the last-level cache is not timed from it.

Paths:
- ``fp32``: the contiguous cache, keys key-major (the baseline).
- ``int8 naive``: dequantize every token to fp32 every step, then attend.
- ``int8 chunked`` / ``int4 chunked``: dequantize a chunk at a time, online softmax.
- ``int8 chunked per-token``: as above with keys grouped per token, the grouping the integer path needs.
- ``int8 int-dot``: integer q.k on the int8 codes (``torch._int_mm``), values dequantized per chunk.

Not a test: timings on a shared machine vary; run it a few times. ``python benchmarks/codec_paths.py --help``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from kvlab.cache.base import CacheShape, KVCache
from kvlab.cache.codec.kivi import QuantizedKVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.machine.timing import cpu_name, measure_bandwidth, time_call


def paths(group_size: int, chunk_size: int, residual: int) -> dict[str, Callable[[CacheShape, int, int], KVCache]]:
    """Cache factories ``(shape, batch_size, capacity) -> KVCache``, by path name."""

    def quantized(**kw):
        return lambda *args: QuantizedKVCache(
            *args, group_size=group_size, chunk_size=chunk_size, residual=residual, **kw
        )

    return {
        "fp32": ContiguousKVCache,
        "int8 naive": quantized(codec="int8", attention="naive"),
        "int8 chunked": quantized(codec="int8"),
        "int4 chunked": quantized(codec="int4"),
        "int8 chunked per-token": quantized(codec="int8", key_quant="per-token"),
        "int8 int-dot": quantized(codec="int8", key_quant="per-token", attention="int-dot"),
    }


def time_steps(cache: KVCache, n_heads: int, steps: int, flush: torch.Tensor) -> list[float]:
    """Seconds per decode step (``reserve``, then ``append`` + ``attend`` per layer), one warm-up step first."""
    gen = torch.Generator().manual_seed(1)
    # one new token's queries grouped by the KV head they share, pre-scaled as the attention module does
    groups = n_heads // cache.n_kv_heads
    q = torch.randn(cache.batch_size, cache.n_kv_heads, groups, 1, cache.head_dim, generator=gen) * cache.head_dim**-0.5
    kv = torch.randn(cache.batch_size, 1, cache.n_kv_heads, cache.head_dim, generator=gen)

    def step() -> None:
        cache.reserve(1)
        for layer in range(cache.n_layers):
            cache.append(layer, kv, kv)
            cache.attend(layer, q)

    times = []
    for i in range(steps + 1):
        flush.sum()  # evict the cache's bytes from the LLC, as a step's weights would
        (seconds,) = time_call(step, 1, warmup=0, device=cache.device)
        if i:
            times.append(seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--paths", nargs="+", default=None, help="default: all; fp32 always runs, first")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--residual", type=int, default=128)
    parser.add_argument("--flush-mb", type=float, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    factories = paths(args.group_size, args.chunk_size, args.residual)
    names = args.paths or list(factories)
    names = ["fp32", *(n for n in names if n != "fp32")]  # the baseline the others are compared with

    bw = measure_bandwidth("cpu", size_mb=512, repeats=5)
    print(f"# {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# copy bandwidth {bw.copy_gbps:.1f} GB/s (best {bw.copy_best_gbps:.1f}), read {bw.read_gbps:.1f} GB/s")
    print(
        f"# {args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads of {args.head_dim}, batch 1; "
        f"G={args.group_size}, chunk={args.chunk_size}, residual={args.residual}; {args.steps} steps each"
    )
    print(f"{'context':>8} {'path':<24} {'ms/step':>9} {'p10-p90':>15} {'MB/step':>9} {'GB/s':>6} {'x fp32':>7}")
    flush = torch.ones(int(args.flush_mb * 1e6 / 4))
    for context in args.contexts:
        baseline = None
        for name in names:
            shape = CacheShape(args.layers, args.kv_heads, args.head_dim)
            cache = factories[name](shape, 1, context + args.steps + 1)
            cache.fast_fill(context, generator=torch.Generator().manual_seed(0))
            times = time_steps(cache, args.heads, args.steps, flush)
            ms = statistics.median(times) * 1e3
            deciles = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
            step_bytes = cache.bytes_read_per_step(context + 1)
            baseline = baseline or ms
            print(
                f"{context:>8} {name:<24} {ms:>9.2f} {deciles[0] * 1e3:>7.1f}-{deciles[-1] * 1e3:<7.1f} "
                f"{step_bytes / 1e6:>9.1f} {step_bytes / (ms / 1e3) / 1e9:>6.1f} {ms / baseline:>7.2f}",
                flush=True,
            )
            del cache


if __name__ == "__main__":
    main()
