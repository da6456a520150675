"""Speculative decoding on this machine: acceptance against k, and the measured speedup against the byte model's.

    python benchmarks/speculative.py                          # the shipped checkpoint, prompt lookup, k = 1..8
    python benchmarks/speculative.py --draft kvlab-tiny-draft  # a shipped draft checkpoint as the drafter
    python benchmarks/speculative.py --inflate 16384          # the target's MLPs padded past the CPU's caches
    python benchmarks/speculative.py --quick                  # fewer prompts and tokens (a smoke run)

Prompts are slices of the held-out text (Python source, which repeats itself: prompt lookup's best case). Greedy
decoding throughout, so the speculative output is checked to equal plain decoding's. For each k the table shows
the acceptance rate, the tokens per verify step, two predicted speedups and the measured one (plain decoding time /
speculative time for the same tokens, interleaved, median of repeats):

- bytes: ``kvlab.roofline.predict_speculative``, the target's bytes per step once per round and the draft's k
  times, as if every call cost its bytes alone (a verify step of k + 1 positions costing one decode step);
- cost: the same runs, with each call's measured time instead of its bytes: ``T(n)`` a target call over ``n``
  positions (``kvlab.engine.speculative.time_verify_steps``; ``T(1)`` is a plain decode step), ``D`` a draft step.
  A run of ``N`` tokens costs plain decoding ``N x T(1)``, and speculation ``T(p + 1)`` for each verify step
  offered ``p`` drafts (prompt lookup often offers fewer than k) plus ``D`` for each draft step.

``--inflate D_FF`` pads the target's MLPs with all-zero units (``kvlab.engine.speculative.inflate_mlp``: the same
tokens, more bytes per step), so that the target streams from memory rather than from the last-level cache.
A benchmark, not a test: run it on an idle machine and report what it prints.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvlab.engine.speculative import PROMPT_LOOKUP, inflate_mlp, speculative_generate, time_verify_steps
from kvlab.machine.timing import machine_info, time_interleaved
from kvlab.model.pretrained import bos_token, heldout_tokens, list_pretrained, load_pretrained
from kvlab.roofline import predict, predict_speculative


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="kvlab-tiny-stdlib", choices=list_pretrained())
    parser.add_argument("--draft", default=PROMPT_LOOKUP, help=f"{PROMPT_LOOKUP!r} or a shipped checkpoint")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="drafts per verify step, comma-separated")
    parser.add_argument("--prompts", type=int, default=8, help="held-out slices to continue")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per k (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--inflate", type=int, help="pad the target's MLPs to this many hidden units")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats, args.ks = 2, 32, 2, "1,4"
    torch.set_num_threads(args.threads)

    target = load_pretrained(args.target, device="cpu")
    if args.inflate:
        target = inflate_mlp(target, args.inflate)
    draft = args.draft if args.draft == PROMPT_LOOKUP else load_pretrained(args.draft, device="cpu")
    text, first = heldout_tokens(), bos_token(args.target)
    stride = len(text) // args.prompts
    prompts = [text[i * stride : i * stride + args.prompt_tokens] for i in range(args.prompts)]
    if first is not None:
        prompts = [torch.cat((torch.tensor([first]), p[:-1])) for p in prompts]
    context = args.prompt_tokens + args.new_tokens // 2
    target_bytes = predict(target.cfg, context, 1.0).bytes_per_step
    draft_bytes = 0 if isinstance(draft, str) else predict(draft.cfg, context, 1.0).bytes_per_step
    ks = [int(x) for x in args.ks.split(",")]
    widths = range(1, max(ks) + 2)
    verify = {n: statistics.median(t) for n, t in time_verify_steps(target, prompts[0], widths, args.repeats).items()}
    draft_s = (
        0.0 if isinstance(draft, str) else statistics.median(time_verify_steps(draft, prompts[0], [1], args.repeats)[1])
    )
    print(f"machine: {machine_info()['cpu']}, {args.threads} thread(s); target {target.cfg.name}, draft {args.draft}")
    print(f"byte model at {context} tokens: target {target_bytes:,} B per step, draft {draft_bytes:,} B per step")
    print(
        "measured ms per target call of n positions: "
        + ", ".join(f"T({n}) {t * 1e3:.2f}" for n, t in sorted(verify.items()))
        + f"; draft step D {draft_s * 1e3:.2f}"
    )
    print(
        f"{'k':>2}  {'accepted':>8}  {'a/draft':>7}  {'tok/step':>8}  {'model':>5}  {'bytes':>6}  {'cost':>6}  "
        f"{'measured':>8}"
    )

    plain = [target.generate(p, args.new_tokens) for p in prompts]
    for k in ks:
        results = [speculative_generate(target, p, args.new_tokens, draft=draft, k=k) for p in prompts]
        for got, want in zip(results, plain, strict=True):
            assert torch.equal(got.tokens, want), "greedy speculative output must equal plain decoding"
        accepted, proposed = sum(r.accepted for r in results), sum(r.proposed for r in results)
        per_draft = accepted / (accepted + sum(r.rejections for r in results))  # acceptance_per_draft, pooled
        tokens_per_step = sum(len(r.tokens) for r in results) / sum(r.verify_steps for r in results)
        model = predict_speculative(target_bytes, k, per_draft, 1.0, draft_bytes)
        times = time_interleaved(
            {
                "plain": lambda: [target.generate(p, args.new_tokens) for p in prompts],
                "speculative": lambda k=k: [
                    speculative_generate(target, p, args.new_tokens, draft=draft, k=k) for p in prompts
                ],
            },
            repeats=args.repeats,
        )
        measured = statistics.median(times["plain"]) / statistics.median(times["speculative"])
        spent = sum(sum(verify[p + 1] for p in r.proposed_per_step) + r.draft_steps * draft_s for r in results)
        cost = sum(len(r.tokens) for r in results) * verify[1] / spent
        print(
            f"{k:>2}  {accepted / proposed:>8.2f}  {per_draft:>7.2f}  {tokens_per_step:>8.2f}  "
            f"{model.tokens_per_step:>5.2f}  {model.speedup:>5.2f}x  {cost:>5.2f}x  {measured:>7.2f}x"
        )
    print(
        "accepted: drafts kept / drafts offered. a/draft: the chance a draft is kept once the ones before it were "
        "(accepted / (accepted + rejections)), the a of (1 - a^(k+1)) / (1 - a), whose value is the model column "
        "(tok/step is measured). bytes: plain bytes per token over speculative at that a, as if every call cost its "
        "bytes alone. cost: measured tok/step with each call's measured time. measured: wall time of whole runs, "
        "which also pays the drafting logic and the cache rollbacks."
    )


if __name__ == "__main__":
    main()
