"""Train the small checkpoint that ships with kvlab: on CPU, in minutes, from text that comes with Python itself.

    python -m kvlab.measure.train --seed 0 --threads 2

The data needs no download. Sequences are windows of the standard library's top-level ``.py`` modules; in a
share of them (``needle_fraction``) a passkey token is planted and asked for later, one to ``max_asks`` times,
so the model learns to find it across the context (the task ``kvlab.measure.quality`` measures as needle recall). The
held-out files never enter training; the evaluation text shipped in ``kvlab/data`` was cut from them, so the
recorded perplexity reproduces on any Python version.

``--bos`` starts every training sequence with ``<|endoftext|>``, as chat models see a beginning-of-text token in
front of every input. A token that is always there is where a head can park attention it does not need, the
attention sink StreamingLLM keeps; without one (the default) the model has no such place. The card of each
checkpoint records what it shows (``sink_study``): window-only against window + sinks perplexity past the trained
length, and the share of attention that lands on the first token.

The loss is the mean text loss plus ``needle_weight`` times the mean loss of the answers, kept apart because the
answers are a handful of a batch's predictions (why 0.25: ``docs/measurements.md``, "Training the shipped
checkpoint").

Determinism: every random draw (initial weights, windows, needles) comes from generators seeded by ``seed``, and
``torch.use_deterministic_algorithms`` is on. The same seed, thread count, torch build and CPU give bit-identical
losses and weights. A different thread count or CPU may reorder floating-point sums, and a different Python
version has a different standard library, so the run then differs slightly.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvlab.cache.base import CacheFactory, default_cache
from kvlab.cache.policy.window import POSITIONS, WindowKVCache
from kvlab.machine.timing import Stopwatch, machine_info
from kvlab.measure.quality import CHANCE, attention_sink_share, needle_recall, perplexity, uniform_first_token_share
from kvlab.model.decoder import Decoder
from kvlab.model.pretrained import HELDOUT_FILE, heldout_tokens
from kvlab.model.tokenizer import ASK, EOT, EOT_TEXT, N_PASSKEYS, VOCAB_SIZE, is_passkey, passkey
from kvlab.spec.config import ModelConfig

# The sink study (``sink_study``): past the trained length, where a window without sinks is all a model keeps.
SINK_CONTEXT, SINK_SEGMENTS, SINK_WINDOW, SINKS = 1024, 8, 64, 4
SINK_QUERIES = 64  # the attention share is that of the last 64 queries at the trained length
# Held out by name, so they stay out of training on every Python version. Present since 3.9 (graphlib) or earlier.
HELDOUT_FILES = ("fractions.py", "graphlib.py", "shlex.py", "textwrap.py")
# The slice of the held-out text whose perplexity the card records and the tests reproduce.
EVAL_SLICE = 4096
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class TrainConfig:
    """Model shape, data mix and optimiser settings for one run. ``seq_len`` is also the model's max_seq_len."""

    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 512
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 1200
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    needle_fraction: float = 0.5
    max_asks: int = 3
    needle_weight: float = 0.25
    seed: int = 0
    threads: int = 2
    bos: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.needle_fraction <= 1:
            raise ValueError(f"needle_fraction: {self.needle_fraction}; allowed: a number in [0, 1]")
        if self.needle_weight < 0:
            raise ValueError(f"needle_weight: {self.needle_weight}; allowed: a number >= 0")
        if self.max_asks < 1 or 4 * self.max_asks + 4 > self.seq_len:
            raise ValueError(
                f"max_asks: {self.max_asks}; allowed: >= 1 and 4 * max_asks + 4 <= seq_len={self.seq_len} "
                "(each ask adds two tokens, and at least as much text must remain)"
            )
        for name in ("steps", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)}; allowed: an integer >= 1")

    def model_config(self, name: str = "custom") -> ModelConfig:
        return ModelConfig(
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            d_ff=self.d_ff,
            vocab_size=VOCAB_SIZE,
            max_seq_len=self.seq_len,
            tie_embeddings=True,
            name=name,
        )


@dataclass
class TrainResult:
    """``losses``: the text loss of every step (nats per byte); ``answer_losses``: the passkey answers' loss, for
    the steps whose batch held a question."""

    model: Decoder
    losses: list[float]
    answer_losses: list[float]
    wall_time_s: float
    tokens_seen: int


# -- data --------------------------------------------------------------------------------------------------------
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def training_files(root: Path | None = None) -> list[Path]:
    """The stdlib's top-level modules minus the held-out ones, sorted by name.

    Top-level modules only: packages such as ``test``, ``idlelib``, ``tkinter`` and ``lib2to3`` are split off or
    dropped by some distributions, while the top-level modules are part of every CPython installation.
    """
    root = stdlib_dir() if root is None else root
    return sorted(p for p in root.glob("*.py") if p.name not in HELDOUT_FILES)


def training_corpus(root: Path | None = None) -> torch.Tensor:
    """The training files' bytes, each followed by ``EOT``: ``[N]`` int16 (half the memory of int64)."""
    chunks = []
    for path in training_files(root):
        chunks.append(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).to(torch.int16))
        chunks.append(torch.tensor([EOT], dtype=torch.int16))
    return torch.cat(chunks)


def heldout_text(root: Path | None = None) -> str:
    """The held-out files, joined by ``<|endoftext|>``: the text shipped as ``kvlab/data/stdlib_heldout.txt``."""
    root = stdlib_dir() if root is None else root
    return EOT_TEXT.join((root / name).read_text(encoding="utf-8") for name in HELDOUT_FILES)


def sample_batch(corpus: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` int64: inputs are ``[:, :-1]``, targets ``[:, 1:]``.

    With ``cfg.bos`` every row is ``<|endoftext|>`` and then the row the plain recipe draws, less its last token,
    so both recipes draw the same random numbers and the same text.
    """
    n = cfg.seq_len + 1
    rows = torch.stack(
        [
            _needle_row(corpus, n, cfg.max_asks, gen)
            if torch.rand((), generator=gen) < cfg.needle_fraction
            else _window(corpus, n, gen)
            for _ in range(cfg.batch_size)
        ]
    )
    if not cfg.bos:
        return rows
    return torch.cat((torch.full((cfg.batch_size, 1), EOT, dtype=rows.dtype), rows[:, :-1]), dim=1)


def _window(corpus: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(len(corpus) - n + 1, (), generator=gen))
    return corpus[start : start + n].long()


def _needle_row(corpus: torch.Tensor, n: int, max_asks: int, gen: torch.Generator) -> torch.Tensor:
    """A window with one passkey planted and asked for 1..max_asks times later (``<|ask|>`` then the passkey).

    Each ask's distance from the passkey is log-uniform over the window: short gaps, which local attention can
    bridge early in training, teach what to copy; long ones teach finding it anywhere in the context.
    """
    k = int(torch.randint(1, max_asks + 1, (), generator=gen))
    key = passkey(int(torch.randint(N_PASSKEYS, (), generator=gen)))
    filler = _window(corpus, n - 1 - 2 * k, gen)
    gaps = torch.exp(torch.rand(k, generator=gen) * math.log(len(filler) - 1)).long().clamp(1, len(filler) - 1)
    at = int(torch.randint(len(filler) - int(gaps.max()) + 1, (), generator=gen))
    pieces, last = [filler[:at], torch.tensor([key])], at
    for cut in (at + gaps).sort().values.tolist():
        pieces += [filler[last:cut], torch.tensor([ASK, key])]
        last = cut
    pieces.append(filler[last:])
    return torch.cat(pieces)


def split_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` ``[B, T+1]`` -> ``inputs`` ``[B, T]``, ``text_targets`` ``[B, T]`` and ``answers`` (bool ``[B, T]``).

    ``answers`` marks the positions holding ``<|ask|>``, whose target is the passkey to recall. Text targets are
    -100 (ignored) there and wherever the target is ``<|ask|>`` or a planted passkey: those are drawn at random,
    and learning their frequency teaches nothing.
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]
    answers = inputs == ASK
    return inputs, targets.masked_fill(answers | (targets == ASK) | is_passkey(targets), -100), answers


# -- training ----------------------------------------------------------------------------------------------------
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    cfg: TrainConfig, corpus: torch.Tensor | None = None, log: Callable[[str], None] | None = print, log_every: int = 50
) -> TrainResult:
    """Train a ``Decoder`` from scratch on CPU; ``corpus`` defaults to ``training_corpus()``."""
    with _deterministic(cfg.threads):
        return _train(cfg, training_corpus() if corpus is None else corpus, log, log_every)


@contextmanager
def _deterministic(threads: int) -> Iterator[None]:
    """Fix the thread count and deterministic kernels for the run, then restore the caller's settings."""
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def _train(cfg: TrainConfig, corpus: torch.Tensor, log: Callable[[str], None] | None, log_every: int) -> TrainResult:
    gen = torch.Generator().manual_seed(cfg.seed)
    model = Decoder(cfg.model_config(), device="cpu", seed=cfg.seed).train()
    params = list(model.parameters())
    # Decay the matrices only: shrinking a norm's gain fights the normalisation instead of regularising.
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    losses: list[float] = []
    answer_losses: list[float] = []
    watch = Stopwatch("cpu")
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sample_batch(corpus, cfg, gen)
        inputs, text_targets, answers = split_targets(batch)
        logits = model(inputs)
        text_loss = F.cross_entropy(logits.flatten(0, 1), text_targets.flatten(), ignore_index=-100)
        loss = text_loss
        if answers.any():
            answer_loss = F.cross_entropy(logits[answers], batch[:, 1:][answers])
            loss = loss + cfg.needle_weight * answer_loss
            answer_losses.append(answer_loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(text_loss.item())
        if log is not None and ((step + 1) % log_every == 0 or step + 1 == cfg.steps):
            elapsed = watch.elapsed()
            log(
                f"step {step + 1}/{cfg.steps}  text loss {_mean(losses[-log_every:]):.4f}  "
                f"answer loss {_mean(answer_losses[-log_every:]):.4f}  lr {lr_at(step, cfg):.2e}  "
                f"{elapsed:.0f}s  {(step + 1) * batch.numel() / elapsed:.0f} tok/s"
            )
    wall = watch.elapsed()
    return TrainResult(model.eval(), losses, answer_losses, wall, cfg.steps * cfg.batch_size * (cfg.seq_len + 1))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


# -- evaluation, checkpoint and card -----------------------------------------------------------------------------
def evaluate(model: Decoder, context: int, n_trials: int = 40, bos: bool = False) -> dict:
    """What the card records: held-out perplexity (the fixed slice and the whole text), passkey recall, and the
    sink study. ``bos``: the model was trained with ``<|endoftext|>`` first, so every segment and prompt starts
    with it."""
    tokens, first = heldout_tokens(), EOT if bos else None
    sliced = perplexity(model, tokens[:EVAL_SLICE], context=context, progress=False, bos=first)
    whole = perplexity(model, tokens, context=context, progress=False, bos=first)
    needles = needle_recall(model, [context], NEEDLE_DEPTHS, n_trials=n_trials, progress=False, bos=first)
    return {
        "bos": bos,
        "heldout_file": HELDOUT_FILE,
        "slice": [0, EVAL_SLICE],
        "context": context,
        "prefill_tokens": sliced.prefill_tokens,
        "perplexity": sliced.ppl,
        "whole_heldout": {"tokens": len(tokens), "scored": whole.n_scored, "perplexity": whole.ppl},
        "needle": [
            {
                "context": r.context,
                "depth": r.depth,
                "distance": r.distance,
                "accuracy": r.accuracy,
                "answer_prob": r.answer_prob,
            }
            for r in needles
        ],
        "needle_trials": n_trials,
        "sinks": sink_study(model, bos),
    }


def sink_study(model: Decoder, bos: bool) -> dict:
    """Does the model lean on its first tokens? Held-out perplexity at ``SINK_CONTEXT`` (past the trained length)
    with the full cache, a window of ``SINK_WINDOW`` alone, and the window plus ``SINKS`` first tokens under both
    position schemes; and per layer, the share of attention the first token receives at the trained length
    against an even spread's share (``kvlab.measure.quality.attention_sink_share``)."""
    tokens, first = heldout_tokens(), EOT if bos else None
    policies: dict[str, CacheFactory] = {
        "full": default_cache,
        "window": partial(WindowKVCache.for_model, window=SINK_WINDOW),
        **{
            f"window+sinks/{scheme}": partial(
                WindowKVCache.for_model, window=SINK_WINDOW, sinks=SINKS, positions=scheme
            )
            for scheme in POSITIONS
        },
    }
    text = tokens[: SINK_SEGMENTS * (SINK_CONTEXT - int(bos))]
    context = model.cfg.max_seq_len
    return {
        "context": SINK_CONTEXT,
        "segments": SINK_SEGMENTS,
        "window": SINK_WINDOW,
        "sinks": SINKS,
        "perplexity": {
            name: perplexity(model, text, SINK_CONTEXT, make_cache, progress=False, bos=first).ppl
            for name, make_cache in policies.items()
        },
        "first_token_share": attention_sink_share(
            model, tokens, context, SINK_SEGMENTS // 2, bos=first, queries=SINK_QUERIES
        ),
        "uniform_share": uniform_first_token_share(context, SINK_QUERIES),
        "share_context": context,
        "share_queries": SINK_QUERIES,
    }


def write_checkpoint(out: Path, name: str, model: Decoder, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / f"{name}.safetensors")
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(card(name, record, (out / f"{name}.safetensors").stat().st_size))


def card(name: str, record: dict, size_bytes: int) -> str:
    m, t, e, run = record["model"], record["training"], record["eval"], record["run"]
    needle_rows = "\n".join(
        f"| {n['depth']:.2f} | {n['distance']} | {n['accuracy']:.2f} | {n['answer_prob']:.3f} |" for n in e["needle"]
    )
    n_params = run["n_params"]
    bos_data = (
        "\n- **Beginning of text**: every training sequence starts with `<|endoftext|>` (`--bos`), and every "
        "evaluation\n  segment and prompt below starts with it too."
        if t.get("bos")
        else ""
    )
    note = f"\n- {run['note']}" if run.get("note") else ""
    load = (
        f"Load average at start and\n  end: {run['load_start']} / {run['load_end']}; the run itself adds about "
        f"{t['threads']}, more means other jobs\n  shared the cores."
        if run.get("load_start")
        else "Load average not recorded."
    )
    return f"""# {name}

A {m["n_layers"]}-layer byte-level Llama-style decoder ({n_params / 1e6:.2f} M parameters, fp32,
{size_bytes / 1e6:.2f} MB), trained on CPU for kvlab's lessons on KV-cache mitigations. It is small enough to
train in minutes and to run quality sweeps on a laptop; it is not a useful language model.

## Shape
d_model {m["d_model"]}, {m["n_heads"]} query heads and {m["n_kv_heads"]} KV heads (GQA), head_dim {m["head_dim"]},
SwiGLU d_ff {m["d_ff"]}, RoPE theta {m["rope_theta"]:g}, tied embeddings, vocabulary {m["vocab_size"]} (256
bytes, `<|endoftext|>`, {N_PASSKEYS} passkeys and `<|ask|>`), trained at {t["seq_len"]} tokens (`max_seq_len`).
Past {t["seq_len"]} tokens the model meets RoPE positions it never saw in training.

## Data
- **Python's standard library**, the top-level `.py` modules of the interpreter that ran the training
  ({run["training_files"]} files, {run["corpus_tokens"]:,} tokens, Python {run["machine"]["python"]}), each file
  followed by `<|endoftext|>`. Why this text: it is on every machine that has Python, needs no download, is
  under the PSF licence, and has long-range structure, such as imports and names defined hundreds of lines
  before their use, which gives attention over a long context something to find. Packages (`test`, `idlelib`,
  `tkinter`, ...) are left out because some distributions split them off.
- **Passkey task**, in {t["needle_fraction"]:.0%} of sequences: one of {N_PASSKEYS} passkey tokens planted at a
  random point of a stdlib window, then `<|ask|>` followed by the passkey, 1 to {t["max_asks"]} times, each at a
  log-uniform distance after it. Loss: mean text loss + {t["needle_weight"]:g} x mean loss of the answers.
  Why one token: a needle spelled in bytes (`# key 0042 = 1234`, tried for an earlier checkpoint) has to be
  copied span by span, which needs induction heads, and a run of this size stayed at chance on it. One token
  keeps the test about the cache: a policy that keeps the passkey's key and value lets the model answer.
- **Held out**: {", ".join(f"`{f}`" for f in HELDOUT_FILES)}, excluded from training by name on every Python
  version. `kvlab/data/{e["heldout_file"]}` holds them as they are in Python {run["machine"]["python"]}
  ({e["whole_heldout"]["tokens"]:,} tokens, joined by `<|endoftext|>`), so the evaluation text is the same on
  every machine. Copyright Python Software Foundation, under the PSF License Agreement
  (https://docs.python.org/3/license.html).{bos_data}

## Training
{t["steps"]} steps of {t["batch_size"]} x {t["seq_len"] + 1} tokens ({run["tokens_seen"]:,} tokens), AdamW
(betas 0.9/0.95, weight decay {t["weight_decay"]} on matrices), lr {t["lr"]:g} with {t["warmup_steps"]} warmup
steps and cosine decay to {t["min_lr_ratio"]:g}x, gradient clip {t["grad_clip"]}, seed {t["seed"]},
{t["threads"]} threads.

- Final train loss (mean of the last 50 steps): text **{run["final_loss"]:.4f}** nats/byte, passkey answers
  {run["final_answer_loss"]:.4f} nats
- Training wall time: **{run["wall_time_s"] / 60:.1f} min** on {run["machine"]["cpu"]}
  ({run["machine"]["logical_cpus"]} logical CPUs, torch {run["machine"]["torch"]}). {load}
- Date: {run["date"]}{note}

## Evaluation (full KV cache, streamed: prefill {e["prefill_tokens"]} token, then one decode step per token)
- Held-out perplexity, the recorded slice (tokens {e["slice"][0]}..{e["slice"][1]}, context {e["context"]}):
  **{e["perplexity"]:.4f}** ({math.log2(e["perplexity"]):.3f} bits/byte). `tests/test_train.py` reproduces it.
- Whole held-out text, context {e["context"]} ({e["whole_heldout"]["scored"]:,} tokens scored):
  {e["whole_heldout"]["perplexity"]:.4f}
- Passkey recall at context {e["context"]}, {e["needle_trials"]} trials per depth (chance
  {CHANCE:.3f}; the answer is the greedy token after `<|ask|>`):

| depth | distance (tokens) | accuracy | mean p(passkey) |
|---|---|---|---|
{needle_rows}

{sink_section(e["sinks"], bool(t.get("bos")))}

## Reproduce
```
{run["command"]}
```
Determinism: the same seed, thread count, torch build and CPU give bit-identical losses and weights. Another
thread count, CPU or torch version may reorder floating-point sums, and another Python version has a different
standard library to train on, so numbers then differ slightly; the held-out evaluation text does not change.
"""


def sink_section(study: dict, bos: bool) -> str:
    """The card's sink study: the table ``sink_study`` measured, and what it says, worded from the numbers."""
    ppl, w, n = study["perplexity"], study["window"], study["sinks"]
    rows = "\n".join(f"| {name} | {value:.3f} |" for name, value in ppl.items())
    change = {scheme: ppl[f"window+sinks/{scheme}"] / ppl["window"] - 1 for scheme in POSITIONS}
    ratios = [share / study["uniform_share"] for share in study["first_token_share"]]
    first = "`<|endoftext|>`" if bos else "the first byte of text"
    verdict = (
        "The model leans on its first tokens: keeping them matters."
        if min(change.values()) < -0.2
        else "No attention sink strong enough to matter formed."
    )
    return f"""## Attention sinks (`sink_study`)
Held-out perplexity at {study["context"]} tokens, past the trained length ({study["segments"]} segments), with a
window of {w} recent tokens alone and with the first {n} tokens kept as well ("sinks", StreamingLLM's scheme).
Positions `original`: the kept tokens keep their RoPE positions; `reassigned`: positions count inside the cache.

| cache | perplexity |
|---|---|
{rows}

{verdict} With {n} sinks the window's perplexity changes by {change["original"]:+.1%} (original positions)
and {change["reassigned"]:+.1%} (reassigned). For comparison, StreamingLLM (Xiao et al. 2023, arXiv 2309.17453,
Table 1): Llama-2-13B with a 1024-token window alone reaches perplexity 5158 on a 65k-token book; 4 sinks + 1020
bring it to 5.40. The share of their attention that the last {study["share_queries"]} of {study["share_context"]}
queries give {first}, per layer: {", ".join(f"{r:.1f}x" for r in ratios)} an even spread's
({study["uniform_share"]:.4f})."""


def parser() -> argparse.ArgumentParser:
    """``python -m kvlab.measure.train``'s options: one per ``TrainConfig`` field, then where to write the
    checkpoint."""
    cli = argparse.ArgumentParser(prog="python -m kvlab.measure.train", description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(TrainConfig):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):  # type=bool would read "--bos False" as True
            cli.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            cli.add_argument(flag, type=type(f.default), default=f.default)
    cli.add_argument("--name", default="kvlab-tiny-stdlib", help="checkpoint name (file stem)")
    cli.add_argument("--out", type=Path, default=Path(__file__).parent / "data", help="output folder")
    cli.add_argument("--log-every", type=int, default=50)
    cli.add_argument(
        "--write-heldout", action="store_true", help=f"(re)write {HELDOUT_FILE} from this Python's stdlib first"
    )
    return cli


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if args.write_heldout:
        (args.out / HELDOUT_FILE).write_text(heldout_text(), encoding="utf-8")
    load_start = [round(x, 2) for x in os.getloadavg()]
    corpus = training_corpus()
    result = train(cfg, corpus, log=lambda s: print(s, flush=True), log_every=args.log_every)
    load_end = [round(x, 2) for x in os.getloadavg()]
    print("evaluating ...", flush=True)
    model_cfg = dataclasses.asdict(cfg.model_config(args.name))
    record = {
        "model": model_cfg,
        "training": dataclasses.asdict(cfg),
        "eval": evaluate(result.model, cfg.seq_len, bos=cfg.bos),
        "run": {
            "final_loss": _mean(result.losses[-50:]),
            "final_answer_loss": _mean(result.answer_losses[-50:]),
            "wall_time_s": round(result.wall_time_s, 1),
            "tokens_seen": result.tokens_seen,
            "n_params": sum(p.numel() for p in result.model.parameters()),
            "training_files": len(training_files()),
            "corpus_tokens": len(corpus),
            "load_start": load_start,
            "load_end": load_end,
            "date": datetime.date.today().isoformat(),
            "machine": machine_info(),
            "command": "python -m kvlab.measure.train " + " ".join(argv),
        },
    }
    write_checkpoint(args.out, args.name, result.model, record)
    print(json.dumps({k: record[k] for k in ("eval", "run")}, indent=2))


if __name__ == "__main__":
    main()
