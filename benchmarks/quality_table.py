"""Perplexity and needle recall of the shipped checkpoint under each KV-cache policy, one row per policy and context.

    python benchmarks/quality_table.py                                  # every policy at contexts 512 and 1024
    python benchmarks/quality_table.py --policies full 'window-64*' --trials 50 --json quality.json

A policy is a name and a ``make_cache(model, batch_size, capacity) -> KVCache`` factory; ``POLICIES`` holds the
full cache, windows with and without sinks under both position schemes, H2O at several budgets, and the fp8,
int8 and int4 codecs (KIVI grouping; with the default residual of recent full-precision tokens, and without), with
``fp8-tensor`` beside fp8: one uncalibrated scale (1.0) per tensor, vLLM's default FP8 cache.
Every measurement streams the text through the cache (see ``kvlab.measure.quality``), so the policy acts on every
prediction after the first ``--prefill`` tokens. Needle recall is passkey retrieval: chance is ``1 / N_PASSKEYS``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
from functools import partial
from pathlib import Path

from kvlab.cache.base import CacheFactory, default_cache
from kvlab.cache.codec.kivi import QuantizedKVCache
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.cache.policy.window import WindowKVCache
from kvlab.machine.timing import Stopwatch
from kvlab.measure.quality import CHANCE, needle_recall, perplexity
from kvlab.model.pretrained import bos_token, heldout_tokens, list_pretrained, load_pretrained

WINDOWS = (64, 128, 256)
SINKS = 4
H2O_BUDGETS = (64, 128, 256)
CODECS = ("fp8", "fp8-tensor", "int8", "int4")


def policies() -> dict[str, CacheFactory]:
    """Every row of the table. With no sinks the two position schemes coincide, so that row appears once."""
    rows: dict[str, CacheFactory] = {"full": default_cache}
    for w in WINDOWS:
        rows[f"window-{w}"] = partial(WindowKVCache.for_model, window=w)
        for scheme in ("original", "reassigned"):
            rows[f"window-{w}+{SINKS}sinks/{scheme}"] = partial(
                WindowKVCache.for_model, window=w, sinks=SINKS, positions=scheme
            )
    for budget in H2O_BUDGETS:
        rows[f"h2o-{budget}"] = partial(HeavyHitterKVCache.for_model, heavy=budget // 2, recent=budget - budget // 2)
    for codec in CODECS:
        rows[codec] = partial(QuantizedKVCache.for_model, codec=codec)
    # Residual 0 quantizes every token as soon as its key group fills (at most group_size - 1 stay full precision):
    # the codec's own cost, without the recent tokens that the default residual keeps exact.
    for codec in CODECS:
        rows[f"{codec}/residual-0"] = partial(QuantizedKVCache.for_model, codec=codec, residual=0)
    return rows


POLICIES = policies()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kvlab-tiny-stdlib", choices=list_pretrained())
    parser.add_argument("--policies", nargs="+", default=["*"], help=f"names or globs; known: {', '.join(POLICIES)}")
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 1024], help="the model was trained at 512; 1024 is twice that"
    )
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=32, help="passkey trials per (context, depth)")
    parser.add_argument("--tokens", type=int, default=16384, help="score the first N held-out tokens (0: all)")
    parser.add_argument("--prefill", type=int, default=1, help="tokens prefilled before decoding token by token")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--progress", action="store_true", help="show progress bars")
    args = parser.parse_args(argv)

    chosen = [name for name in POLICIES if any(fnmatch.fnmatchcase(name, pat) for pat in args.policies)]
    if not chosen:
        parser.error(f"--policies: {args.policies} match nothing; known: {', '.join(POLICIES)}")
    model = load_pretrained(args.model, device=args.device)
    tokens = heldout_tokens()[: args.tokens or None]
    # A checkpoint trained with a beginning-of-text token reads every segment and prompt with one in front.
    common = {
        "prefill_tokens": args.prefill,
        "batch_size": args.batch_size,
        "progress": args.progress,
        "bos": bos_token(args.model),
    }
    rows = []
    for policy in chosen:
        make_cache = POLICIES[policy]
        for context in args.contexts:
            watch = Stopwatch(model.device)
            ppl = perplexity(model, tokens, context=context, make_cache=make_cache, **common)
            needles = needle_recall(
                model, [context], args.depths, n_trials=args.trials, make_cache=make_cache, seed=args.seed, **common
            )
            rows.append(
                {
                    "policy": policy,
                    "context": context,
                    "ppl": ppl.ppl,
                    "bits_per_token": ppl.nll / math.log(2),
                    "scored_tokens": ppl.n_scored,
                    "recall": {n.depth: n.accuracy for n in needles},
                    "recall_mean": sum(n.accuracy for n in needles) / len(needles),
                    "answer_prob_mean": sum(n.answer_prob for n in needles) / len(needles),
                    "seconds": watch.elapsed(),
                }
            )
    print(
        f"model {args.model}, held-out tokens {len(tokens):,}, {args.trials} passkey trials per depth "
        f"(chance {CHANCE:.3f}), prefill {args.prefill}"
    )
    print(format_table(rows, args.depths))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def format_table(rows: list[dict], depths: list[float]) -> str:
    header = ["policy", "context", "ppl", "bits/tok", *(f"recall@{d:g}" for d in depths), "recall", "p(key)", "time s"]
    body = [
        [
            r["policy"],
            str(r["context"]),
            f"{r['ppl']:.3f}",
            f"{r['bits_per_token']:.3f}",
            *(f"{r['recall'][d]:.2f}" for d in depths),
            f"{r['recall_mean']:.2f}",
            f"{r['answer_prob_mean']:.3f}",
            f"{r['seconds']:.0f}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *body])


if __name__ == "__main__":
    main()
