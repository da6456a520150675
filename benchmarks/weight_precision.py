"""Each weight precision on this CPU: the decode step it buys (at zero context and at a longer one, so the weight
term and the KV slope both show) and what it costs the shipped checkpoint in perplexity and passkey recall.

    python benchmarks/weight_precision.py                       # cpu-small steps at one thread, kvlab-tiny quality
    python benchmarks/weight_precision.py --clock thread        # CPU time only: steadier on a loaded machine
    python benchmarks/weight_precision.py --quick               # few repeats, few tokens: a smoke run
    python benchmarks/weight_precision.py --isa avx2            # the kernels an AVX2-only x86 CPU would run

Speed: ``Decoder(cfg, weight_dtype=...)`` for fp32, int8, bf16 and fp16, each stepped once per round in turn, at
``--context`` 1 and at ``--long`` tokens; the predicted step is its weight bytes (``kvlab.roofline``, from the
precision in ``cfg.weight_dtypes``) plus its KV bytes over the read bandwidth measured in the same rounds.
Each row names the kernel its products ran on (``WeightFormat.kernel``): fp16 on fbgemm's kernel on any x86 CPU
with AVX2, bf16 on oneDNN's where the CPU has native bf16 dot products (AVX512-BF16, AMX), and ``cast`` where no
kernel reads the format, which runs several times slower than fp32, as the step shows.

Quality: the shipped checkpoint's weights loaded into each precision, scored on the shipped held-out text
(``kvlab.measure.quality.perplexity``) and by passkey retrieval (``needle_recall``), with the full fp32 KV cache.

``--isa avx2`` runs the same benchmark again in a new process with every kernel library capped at AVX2
(``kvlab.machine.isa``): on a CPU with AVX-512, AVX512-BF16 or AMX, it shows the kernels a laptop without them
runs, on this machine's memory. The environment line records the cap.

A benchmark, not a test: say how loaded the machine was.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import warnings

import torch

from kvlab import Decoder, get_model
from kvlab.machine.isa import ISA_CAPS, capped_environ, isa_caps_in_effect
from kvlab.machine.timing import CLOCKS, bandwidth_buffer_mb, load_average, machine_info, time_interleaved
from kvlab.measure.quality import CHANCE, needle_recall, perplexity
from kvlab.model.pretrained import bos_token, heldout_tokens, list_pretrained, load_pretrained
from kvlab.model.weights import WEIGHT_DTYPES, native_half
from kvlab.roofline import kv_bytes_per_step, weight_bytes_read


def in_precision(cfg, state: dict, dtype: str) -> Decoder:
    """A Decoder reading ``state``'s weights in ``dtype`` (a half precision no kernel reads warns: the table shows
    why)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model = Decoder(cfg, device="cpu", weight_dtype=dtype)
    model.load_state_dict(state)
    return model


@torch.inference_mode()
def speed(preset: str, dtypes: list[str], contexts: list[int], repeats: int, clock: str) -> dict:
    cfg = get_model(preset)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, max(contexts) + 2 * repeats + 16))
    base = Decoder(cfg, device="cpu")
    models = {d: in_precision(cfg, base.state_dict(), d) for d in dtypes}
    token = torch.zeros(1, dtype=torch.long)
    fns = {}
    for d, model in models.items():
        for context in contexts:
            cache = model.new_cache(1, context + 2 * repeats + 16)
            if context > 1:
                cache.fast_fill(context - 1, generator=torch.Generator().manual_seed(0))
            fns[(d, context)] = lambda m=model, c=cache: m.decode_step(token, c)
    n = int(bandwidth_buffer_mb() * 1e6 / 4)
    src = torch.empty(n).normal_()
    fns[("read", 0)] = src.sum
    times = time_interleaved(fns, repeats, warmup=2, clock=clock)
    ms = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    read_gbps = n * 4 / ms[("read", 0)] / 1e6
    rows = []
    for d, model in models.items():
        wbytes = weight_bytes_read(model.cfg)
        for context in contexts:
            kv = kv_bytes_per_step(model.cfg, context)
            rows.append(
                {
                    "weight_dtype": d,
                    "context": context,
                    "ms": ms[(d, context)],
                    "predicted_ms": (wbytes + kv) / read_gbps / 1e6,
                    "weight_mb": wbytes / 1e6,
                    "kernel": model.weights.kernel(model.embed.weight),
                }
            )
    return {"read_gbps": read_gbps, "load": load_average(), "rows": rows}


@torch.inference_mode()
def quality(name: str, dtypes: list[str], tokens: int, context: int, trials: int) -> list[dict]:
    fp32 = load_pretrained(name, device="cpu")
    text = heldout_tokens()[:tokens]
    common = {"progress": False, "bos": bos_token(name), "batch_size": 32}
    rows = []
    for d in dtypes:
        model = in_precision(fp32.cfg, fp32.state_dict(), d)
        ppl = perplexity(model, text, context=context, **common)
        needles = needle_recall(model, [context], [0.0, 0.5, 1.0], n_trials=trials, **common)
        rows.append(
            {
                "weight_dtype": d,
                "ppl": ppl.ppl,
                "scored_tokens": ppl.n_scored,
                "recall": sum(n.accuracy for n in needles) / len(needles),
                "answer_prob": sum(n.answer_prob for n in needles) / len(needles),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu-small", help="the model whose step is timed (random weights)")
    parser.add_argument("--model", default="kvlab-tiny-stdlib", choices=list_pretrained(), help="quality checkpoint")
    parser.add_argument("--dtypes", default=",".join(WEIGHT_DTYPES))
    parser.add_argument("--long", type=int, default=4096, help="the longer context, for the KV slope")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="thread: CPU time (1 thread only)")
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored for perplexity")
    parser.add_argument("--context", type=int, default=512, help="perplexity and passkey context")
    parser.add_argument("--trials", type=int, default=16, help="passkey trials per depth")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--isa", choices=sorted(ISA_CAPS), help="rerun with the kernels capped at this instruction set")
    args = parser.parse_args()
    if args.isa and isa_caps_in_effect() != ISA_CAPS[args.isa]:
        # The libraries read their caps as they load, which this process has done: the run is a new one.
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=capped_environ(args.isa)).returncode)
    if args.quick:
        args.repeats, args.tokens, args.trials, args.long = 4, 2048, 4, 1024
    if args.threads < 1:
        raise ValueError(f"--threads: {args.threads}; allowed: an integer >= 1")
    torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in WEIGHT_DTYPES:
            raise ValueError(f"--dtypes: {d!r}; allowed: {', '.join(WEIGHT_DTYPES)}")
    print("environment:", json.dumps(machine_info()))
    native = {d: native_half(d) for d in ("bf16", "fp16")}
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"native half-precision dot products (oneDNN): {native}; CPU capability {capability}")
    contexts = [1, args.long]
    s = speed(args.preset, dtypes, contexts, args.repeats, args.clock)
    print(
        f"\n{args.preset}, {args.threads} thread(s), {args.clock} clock, median of {args.repeats}; "
        f"read {s['read_gbps']:.1f} GB/s; load average {s['load']}"
    )
    print(
        f"{'weights':>7} {'kernel':>11} {'MB':>7} {'context':>8} {'step ms':>8} {'pred ms':>8} {'x pred':>7} "
        f"{'slope us/tok':>13}"
    )
    by = {(r["weight_dtype"], r["context"]): r for r in s["rows"]}
    for d in dtypes:
        slope = (by[(d, args.long)]["ms"] - by[(d, 1)]["ms"]) / (args.long - 1) * 1e3
        for context in contexts:
            r = by[(d, context)]
            tail = f"{slope:>13.3f}" if context == args.long else ""
            print(
                f"{d:>7} {r['kernel']:>11} {r['weight_mb']:>7.1f} {context:>8} {r['ms']:>8.2f} "
                f"{r['predicted_ms']:>8.2f} {r['ms'] / r['predicted_ms']:>7.2f} {tail}"
            )
    q = quality(args.model, dtypes, args.tokens, args.context, args.trials)
    print(
        f"\n{args.model}: perplexity on {q[0]['scored_tokens']:,} held-out tokens at context {args.context}; "
        f"passkey recall over depths 0, 0.5, 1, {args.trials} trials each (chance {CHANCE:.3f})"
    )
    print(f"{'weights':>7} {'ppl':>8} {'recall':>7} {'p(key)':>7}")
    for r in q:
        print(f"{r['weight_dtype']:>7} {r['ppl']:>8.3f} {r['recall']:>7.2f} {r['answer_prob']:>7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": machine_info(), "speed": s, "quality": q}, f, indent=2)


if __name__ == "__main__":
    main()
