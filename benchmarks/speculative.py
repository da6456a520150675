"""Speculative decoding on this machine: acceptance against k, and the measured speedup against the byte model's.

    python benchmarks/speculative.py                          # the shipped checkpoint, prompt lookup, k = 1..8
    python benchmarks/speculative.py --draft kvlab-tiny-draft  # a shipped draft checkpoint as the drafter
    python benchmarks/speculative.py --quick                  # fewer prompts and tokens (a smoke run)

Prompts are slices of the held-out text (Python source, which repeats itself: prompt lookup's best case). Greedy
decoding throughout, so the speculative output is checked to equal plain decoding's. For each k the table shows
the acceptance rate, the tokens per verify step, the byte model's speedup at that acceptance
(``kvlab.roofline.predict_speculative``: the target's bytes per step once per round, the draft's k times) and the
measured speedup (plain decoding time / speculative time for the same tokens, interleaved, median of repeats).
A benchmark, not a test: run it on an idle machine and report what it prints.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvlab.pretrained import bos_token, heldout_tokens, list_pretrained, load_pretrained
from kvlab.roofline import predict, predict_speculative
from kvlab.speculative import PROMPT_LOOKUP, speculative_generate
from kvlab.timing import machine_info, time_interleaved


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
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats, args.ks = 2, 32, 2, "1,4"
    torch.set_num_threads(args.threads)

    target = load_pretrained(args.target, device="cpu")
    draft = args.draft if args.draft == PROMPT_LOOKUP else load_pretrained(args.draft, device="cpu")
    text, first = heldout_tokens(), bos_token(args.target)
    stride = len(text) // args.prompts
    prompts = [text[i * stride : i * stride + args.prompt_tokens] for i in range(args.prompts)]
    if first is not None:
        prompts = [torch.cat((torch.tensor([first]), p[:-1])) for p in prompts]
    context = args.prompt_tokens + args.new_tokens // 2
    target_bytes = predict(target.cfg, context, 1.0).bytes_per_step
    draft_bytes = 0 if isinstance(draft, str) else predict(draft.cfg, context, 1.0).bytes_per_step
    print(f"machine: {machine_info()['cpu']}, {args.threads} thread(s); target {args.target}, draft {args.draft}")
    print(f"byte model at {context} tokens: target {target_bytes:,} B per step, draft {draft_bytes:,} B per step")
    print(
        f"{'k':>2}  {'accepted':>8}  {'a/draft':>7}  {'tok/step':>8}  {'model':>5}  {'predicted':>9}  {'measured':>8}"
    )

    plain = [target.generate(p, args.new_tokens) for p in prompts]
    for k in (int(x) for x in args.ks.split(",")):
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
        print(
            f"{k:>2}  {accepted / proposed:>8.2f}  {per_draft:>7.2f}  {tokens_per_step:>8.2f}  "
            f"{model.tokens_per_step:>5.2f}  {model.speedup:>8.2f}x  {measured:>7.2f}x"
        )
    print(
        "accepted: drafts kept / drafts offered. a/draft: the chance a draft is kept once the ones before it were "
        "(accepted / (accepted + rejections)), the a of (1 - a^(k+1)) / (1 - a), whose value is the model column "
        "(tok/step is measured). predicted: bytes per token of plain decoding over speculative at that a, as if every "
        "step cost its bytes alone. measured: wall time, which also counts each step's fixed costs (Python, "
        "dispatch) and the verify step's extra positions."
    )


if __name__ == "__main__":
    main()
