"""Each mitigation's measured effect on decode time next to the byte ratio it predicts, on this machine.

    python benchmarks/mitigations.py            # cpu-small, contexts up to 32k
    python benchmarks/mitigations.py --quick    # cpu-tiny, short contexts (a smoke run)

For every row the slope of TPOT against context (µs per token of context) is measured with ``kvlab.measure.sweep`` and
compared with full fp32 MHA measured in the same process; the predicted ratio is the cache's own
``bytes_read_per_step`` ratio. The shared-prefix row compares whole decode steps of a batch instead, because its
saving does not grow with one sequence's context but with the batch that shares it.

Targets (2 CPU cores): GQA with a quarter of the KV heads <= 0.35x MHA's slope; a 1k window keeps TPOT at 32k
within 15% of TPOT at 1k; a batch of 8 sharing a 16k prefix steps in <= 0.4x the time of the unshared batch.
A benchmark, not a test: run it on an idle machine and report what it prints.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

import torch

from kvlab import Decoder, get_model
from kvlab.cache import PagedKVCache, WindowKVCache
from kvlab.cache.base import KVCache
from kvlab.cache.storage.shared_prefix import SharedPrefixKVCache
from kvlab.cli import parse_tokens
from kvlab.machine.timing import bandwidth_buffer_mb, machine_info, measure_bandwidth, time_interleaved
from kvlab.measure.sweep import sweep_context

MakeCache = Callable[[Decoder, int, int], KVCache]


def slope_row(name: str, model: Decoder, contexts: list[int], bw, make_cache: MakeCache | None, args) -> dict:
    sweep = sweep_context(
        model,
        contexts,
        n_tokens=args.tokens,
        n_requests=args.requests,
        bandwidth=bw,
        make_cache=make_cache,
        progress=False,
    )
    points = sweep.points
    return {
        "name": name,
        "slope_us": sweep.fit.slope * 1e3,
        "r2": sweep.fit.r2,
        "tpot_first_ms": points[0].tpot_ms,
        "tpot_last_ms": points[-1].tpot_ms,
        # KV bytes the cache itself says a step reads, at the longest and the shortest context
        "kv_bytes_span": points[-1].bytes_per_step - points[0].bytes_per_step,
    }


def shared_prefix_steps(model: Decoder, prefix: int, batch: int, steps: int) -> dict[str, float]:
    """Median decode-step ms for a batch whose sequences share ``prefix`` tokens, three ways, interleaved."""
    gen = torch.Generator().manual_seed(0)
    contiguous = model.new_cache(batch, prefix + steps + 4)
    contiguous.fast_fill(prefix, generator=gen)
    n_blocks = batch * (prefix // 16 + steps // 16 + 4)
    caches: dict[str, KVCache] = {"unshared (contiguous)": contiguous}
    for name, cascade in (("paged, no cascade", False), ("paged + cascade", True)):
        paged = PagedKVCache.for_model(model, n_blocks=n_blocks, block_size=16, cascade=cascade)
        paged.fast_fill(prefix, generator=gen)
        for _ in range(batch - 1):
            paged.fork(0)
        caches[name] = paged
    shared = SharedPrefixKVCache.for_model(model, batch, prefix + steps + 4)
    shared.fast_fill(prefix, generator=gen)
    shared.branch()
    caches["shared prefix, cascade"] = shared
    tokens = torch.zeros(batch, dtype=torch.long)
    steps_of = {name: functools.partial(model.decode_step, tokens, cache) for name, cache in caches.items()}
    times = time_interleaved(steps_of, steps, warmup=1, device=model.device)
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    out["bytes"] = {name: cache.bytes_read_per_step() for name, cache in caches.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--contexts", default="1k,4k,8k,16k,32k")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--window", default="1k")
    parser.add_argument("--prefix", default="16k")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.contexts, args.window, args.prefix, args.batch = "cpu-tiny", "256,1k,2k", "256", "1k", 4
    contexts = [parse_tokens(c, "--contexts") for c in args.contexts.split(",")]
    window = parse_tokens(args.window, "--window")
    base = get_model(args.preset)
    base = base.replace(max_seq_len=max(base.max_seq_len, max(contexts) + 64))
    print("environment:", machine_info())
    bw = measure_bandwidth("cpu", size_mb=bandwidth_buffer_mb(quick=args.quick))
    print(f"bandwidth: read {bw.read_gbps:.1f} GB/s, copy {bw.copy_gbps:.1f} GB/s, {bw.threads} thread(s)\n")

    mha = Decoder(base, device="cpu")
    rows = [slope_row("MHA fp32 (reference)", mha, contexts, bw, None, args)]
    for kv_heads in sorted({base.n_heads // 4, 1}, reverse=True):
        model = Decoder(base.replace(n_kv_heads=kv_heads), device="cpu")
        rows.append(slope_row(f"{model.cfg.attention_kind} ({kv_heads} KV heads)", model, contexts, bw, None, args))
    window_cache = functools.partial(WindowKVCache.for_model, window=window - 4, sinks=4)
    rows.append(slope_row(f"window {window - 4} + 4 sinks", mha, contexts, bw, window_cache, args))

    ref = rows[0]
    print(
        f"{'mitigation':<28} {'slope us/tok':>12} {'R^2':>6} {'x MHA':>7} {'predicted':>9} "
        f"{'TPOT first':>10} {'TPOT last':>9}"
    )
    for r in rows:
        print(
            f"{r['name']:<28} {r['slope_us']:>12.3f} {r['r2']:>6.3f} {r['slope_us'] / ref['slope_us']:>7.2f} "
            f"{r['kv_bytes_span'] / ref['kv_bytes_span']:>9.2f} {r['tpot_first_ms']:>10.2f} "
            f"{r['tpot_last_ms']:>9.2f}"
        )
    windowed = rows[-1]
    print(
        f"\nwindow: TPOT at {contexts[-1]} is {windowed['tpot_last_ms'] / windowed['tpot_first_ms']:.2f}x "
        f"TPOT at {contexts[0]} (target <= 1.15x)"
    )

    prefix = parse_tokens(args.prefix, "--prefix")
    steps = shared_prefix_steps(mha, prefix, args.batch, steps=8 if args.quick else 12)
    unshared = steps["unshared (contiguous)"]
    print(f"\nbatch {args.batch} sharing a {prefix}-token prefix: ms per decode step (median), KV bytes read")
    for name, bytes_read in steps["bytes"].items():
        print(
            f"  {name:<22} {steps[name]:>8.2f} ms  {steps[name] / unshared:>5.2f}x   "
            f"{bytes_read / 1e6:>8.1f} MB ({bytes_read / steps['bytes']['unshared (contiguous)']:.2f}x)"
        )


if __name__ == "__main__":
    main()
