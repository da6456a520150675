"""Perplexity and needle recall of the shipped checkpoint under each KV-cache policy, one row per policy and context.

    python bench/quality_table.py                       # full cache at contexts 256 and 512
    python bench/quality_table.py --contexts 512 --trials 50 --json quality.json

A policy is a name and a ``make_cache(model, batch_size, capacity) -> KVCache`` factory: to compare a mitigation
(window + sinks, heavy hitters, a quantized codec), add it to ``POLICIES``. Every measurement streams the text
through the cache (see ``kvlab.quality``), so the policy acts on every prediction after the first
``--prefill`` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from kvlab.pretrained import heldout_tokens, list_pretrained, load_pretrained
from kvlab.quality import CacheFactory, full_cache, needle_recall, perplexity

POLICIES: dict[str, CacheFactory] = {
    "full": full_cache,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kvlab-tiny-stdlib", choices=list_pretrained())
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=20, help="needle trials per (context, depth)")
    parser.add_argument("--tokens", type=int, default=None, help="score only the first N held-out tokens")
    parser.add_argument("--prefill", type=int, default=1, help="tokens prefilled before decoding token by token")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--progress", action="store_true", help="show progress bars")
    args = parser.parse_args(argv)

    model = load_pretrained(args.model, device=args.device)
    tokens = heldout_tokens()[: args.tokens]
    common = {"prefill_tokens": args.prefill, "batch_size": args.batch_size, "progress": args.progress}
    rows = []
    for policy, make_cache in POLICIES.items():
        for context in args.contexts:
            start = time.perf_counter()
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
                    "seconds": time.perf_counter() - start,
                }
            )
    print(
        f"model {args.model}, held-out tokens {len(tokens):,}, {args.trials} needle trials per depth, "
        f"prefill {args.prefill}"
    )
    print(format_table(rows, args.depths))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def format_table(rows: list[dict], depths: list[float]) -> str:
    header = ["policy", "context", "ppl", "bits/tok", *(f"recall@{d:g}" for d in depths), "recall", "time s"]
    body = [
        [
            r["policy"],
            str(r["context"]),
            f"{r['ppl']:.3f}",
            f"{r['bits_per_token']:.3f}",
            *(f"{r['recall'][d]:.2f}" for d in depths),
            f"{r['recall_mean']:.2f}",
            f"{r['seconds']:.0f}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *body])


if __name__ == "__main__":
    main()
