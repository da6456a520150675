"""What a KV-cache policy costs in quality: perplexity and needle recall, measured while the text streams.

Both measures feed their text through ``prefill`` and ``decode_step`` into a cache built by ``make_cache``, so a
cache that evicts or quantizes while decoding changes every later prediction, exactly as it would in serving.
Only the first ``prefill_tokens`` of each sequence go in as one prefill (the fast path); everything after goes
one token per step.

A cache factory is ``make_cache(model, batch_size, capacity) -> KVCache``; ``capacity`` is the number of tokens
the stream will reach. The default, ``kvlab.cache.base.default_cache``, is the model's own ``new_cache``, which keeps
every token.

``bos``: a model trained with a beginning-of-text token in front of every sequence (``pretrained_info(name)
["training"]["bos"]``) should meet one in front of every segment and prompt too; pass its id (``kvlab.model.EOT``)
and each starts with it, unscored. ``attention_sink_share`` measures whether such a token became an attention sink.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvlab.cache.base import CacheFactory, KVCache, default_cache
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.model.decoder import Decoder
from kvlab.model.pretrained import heldout_tokens
from kvlab.model.tokenizer import ASK, N_PASSKEYS, PASSKEY_BASE, VOCAB_SIZE
from kvlab.spec.validation import require_bool, require_fraction, require_int

# The needle is one passkey token planted in the text, the query is ``<|ask|>``, and the answer is that same
# passkey: recall succeeds only if the passkey's key and value survive in the cache until the question comes.
CHANCE = 1 / N_PASSKEYS


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of the scored tokens: positions ``prefill_tokens .. context-1`` of every segment.

    ``nll`` is the mean negative log-likelihood in nats per token; ``ppl = exp(nll)``. With the byte tokenizer,
    ``nll / ln 2`` is bits per byte. ``nll_by_position[i]`` is the mean over segments at position
    ``prefill_tokens + i``, for plotting loss against how much context a prediction had.
    """

    context: int
    prefill_tokens: int
    n_segments: int
    n_scored: int
    nll: float
    ppl: float
    nll_by_position: tuple[float, ...]


@dataclass(frozen=True)
class NeedleResult:
    """Passkey recall for one (context, depth). The passkey sits at ``needle_position``; the question is the
    prompt's last token, ``distance`` positions later. ``accuracy`` is the share of trials whose greedy answer is
    the passkey (chance: ``CHANCE``); ``answer_prob`` the mean probability given to it, which shows a policy
    blurring the passkey before it flips answers. ``predictions`` and ``answers`` are token ids, per trial."""

    context: int
    depth: float
    needle_position: int
    distance: int
    n_trials: int
    n_correct: int
    accuracy: float
    answer_prob: float
    predictions: tuple[int, ...]
    answers: tuple[int, ...]


def perplexity(
    model: Decoder,
    tokens: torch.Tensor | Sequence[int],
    context: int = 512,
    make_cache: CacheFactory = default_cache,
    prefill_tokens: int = 1,
    batch_size: int = 16,
    progress: bool = True,
    bos: int | None = None,
    one_pass: bool = False,
) -> PerplexityResult:
    """Perplexity of ``tokens`` (``[N]``) read in segments of ``context`` tokens, each through a fresh cache.

    The text is cut into ``N // context`` consecutive segments (a shorter tail is dropped); segments stream in
    batches of ``batch_size``. With ``bos``, each segment is that token followed by ``context - 1`` tokens of text
    (``N // (context - 1)`` segments), so a segment still fills ``context`` positions. In each segment, tokens
    ``0 .. prefill_tokens-1`` are prefilled and the rest are fed one ``decode_step`` at a time. Scored: the
    prediction of every token from ``prefill_tokens`` to the end of its segment, each made with all earlier tokens
    of the segment having passed through the cache. The first of those predictions comes from the prefill's last
    position; the rest from decode steps.

    ``one_pass``: each segment goes in as one prefill, and every scored prediction is read from it. For a cache
    whose multi-token step gives each query what feeding the tokens one at a time would (its class sets
    ``prefill_is_stepwise``: it keeps every token, or evicts by position alone), that is the same measurement,
    equal to the streamed one up to float rounding, for the cost of one step instead of ``context -
    prefill_tokens``. A cache without the property (H2O evicts by what each step attended to) is refused.
    """
    tokens = _token_vector(tokens, "tokens")
    require_int("context", context, 2)
    require_int("prefill_tokens", prefill_tokens, 1)
    if prefill_tokens >= context:
        raise ValueError(f"prefill_tokens: {prefill_tokens}; allowed: 1 <= prefill_tokens < context={context}")
    require_int("batch_size", batch_size, 1)
    require_bool("one_pass", one_pass)
    _check_factory(make_cache)
    _check_bos(bos, model)
    text_len = context - (bos is not None)
    n_segments = len(tokens) // text_len
    if n_segments == 0:
        raise ValueError(f"tokens: {len(tokens)} tokens; allowed: at least {text_len} (context={context})")
    segments = _with_bos(tokens[: n_segments * text_len].view(n_segments, text_len), bos).to(model.device)
    nll_sum = torch.zeros(context - prefill_tokens, dtype=torch.float64)
    with _bar(n_segments * (context - prefill_tokens), f"perplexity ctx={context}", progress) as bar:
        for batch in segments.split(batch_size):
            cache = make_cache(model, batch.shape[0], context)
            if one_pass and not cache.prefill_is_stepwise:
                raise ValueError(
                    f"make_cache: its {type(cache).__name__} does not keep, in a multi-token step, what one token at a "
                    "time would keep; allowed: one_pass=False for it, or a cache whose prefill_is_stepwise is True"
                )
            for i, logits in enumerate(_stream(model, batch[:, :-1], cache, prefill_tokens, bar, one_pass)):
                target = batch[:, prefill_tokens + i]
                logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, target[:, None])
                nll_sum[i] -= logp.double().sum().cpu()
    by_position = nll_sum / n_segments
    nll = float(by_position.mean())
    return PerplexityResult(
        context=context,
        prefill_tokens=prefill_tokens,
        n_segments=n_segments,
        n_scored=n_segments * (context - prefill_tokens),
        nll=nll,
        ppl=math.exp(nll),
        nll_by_position=tuple(by_position.tolist()),
    )


def needle_prompts(
    context: int, depth: float, n_trials: int, filler: torch.Tensor, seed: int = 0, bos: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts of exactly ``context`` tokens: (``bos``,) filler, a passkey at ``depth``, filler, then ``<|ask|>``.

    ``depth`` 0 puts the passkey first (right after ``bos``), 1 right before the question. Each trial draws its
    own passkey and filler offset (the filler ``[N]`` wraps around when a prompt needs more than it holds), from a
    stream seeded by ``(seed, context, depth)`` alone, so a cell's trials do not depend on which other cells are
    run.
    Returns ``prompts`` ``[n_trials, context]``, ``answers`` ``[n_trials]`` (passkey token ids) and the
    passkey's position.
    """
    require_int("context", context, 3 + (bos is not None))
    require_fraction("depth", depth)
    require_int("n_trials", n_trials, 1)
    filler = _token_vector(filler, "filler")
    n_filler = context - 2 - (bos is not None)
    position = round(depth * n_filler)
    rng = random.Random(f"kvlab-passkey:{seed}:{context}:{float(depth)!r}")
    prompts, answers = [], []
    for _ in range(n_trials):
        answer = PASSKEY_BASE + rng.randrange(N_PASSKEYS)
        start = rng.randrange(len(filler))
        text = filler[(start + torch.arange(n_filler)) % len(filler)]
        prompts.append(torch.cat((text[:position], torch.tensor([answer]), text[position:], torch.tensor([ASK]))))
        answers.append(answer)
    return _with_bos(torch.stack(prompts), bos), torch.tensor(answers), position + (bos is not None)


def needle_recall(
    model: Decoder,
    contexts: Sequence[int],
    depths: Sequence[float],
    n_trials: int = 20,
    make_cache: CacheFactory = default_cache,
    seed: int = 0,
    filler: torch.Tensor | Sequence[int] | None = None,
    prefill_tokens: int = 1,
    batch_size: int = 16,
    progress: bool = True,
    bos: int | None = None,
) -> list[NeedleResult]:
    """Passkey recall for every (context, depth), streaming each prompt through the cache.

    Each prompt (see ``needle_prompts``) is fed as ``perplexity`` feeds a segment, so the policy acts from the
    ``prefill_tokens``-th token on; the answer is the greedy prediction after ``<|ask|>``. ``filler`` defaults to
    the shipped held-out text; ``bos`` starts every prompt (see the module docstring).
    """
    contexts, depths = _nonempty("contexts", contexts), _nonempty("depths", depths)
    require_int("n_trials", n_trials, 1)
    require_int("prefill_tokens", prefill_tokens, 1)
    require_int("batch_size", batch_size, 1)
    _check_factory(make_cache)
    _check_bos(bos, model)
    if model.cfg.vocab_size < VOCAB_SIZE:
        raise ValueError(
            f"model: vocab_size {model.cfg.vocab_size} has no passkey or <|ask|> tokens; allowed: a model with "
            f"vocab_size >= {VOCAB_SIZE} (kvlab.model.tokenizer), such as load_pretrained('kvlab-tiny-stdlib')"
        )
    for c in contexts:
        require_int("contexts", c, max(3 + (bos is not None), prefill_tokens + 1))
    for d in depths:
        require_fraction("depths", d)
    filler = heldout_tokens() if filler is None else filler
    cells = [(c, d) for c in contexts for d in depths]
    results = []
    with _bar(sum(n_trials * (c - prefill_tokens + 1) for c, _ in cells), "needle recall", progress) as bar:
        for context, depth in cells:
            prompts, answers, position = needle_prompts(context, depth, n_trials, filler, seed, bos)
            probs = torch.cat(
                [_final_probs(model, p, make_cache, prefill_tokens, bar) for p in prompts.split(batch_size)]
            )
            predicted = probs.argmax(dim=-1)
            n_correct = int((predicted == answers).sum())
            results.append(
                NeedleResult(
                    context=context,
                    depth=float(depth),
                    needle_position=position,
                    distance=context - 1 - position,
                    n_trials=n_trials,
                    n_correct=n_correct,
                    accuracy=n_correct / n_trials,
                    answer_prob=float(probs.gather(-1, answers[:, None]).mean()),
                    predictions=tuple(predicted.tolist()),
                    answers=tuple(answers.tolist()),
                )
            )
    return results


def attention_sink_share(
    model: Decoder,
    tokens: torch.Tensor | Sequence[int],
    context: int = 512,
    n_segments: int = 4,
    bos: int | None = None,
    queries: int | None = None,
) -> list[float]:
    """Per layer, the share of the attention that the last ``queries`` positions of each segment (default: all
    ``context``) give the segment's first token (``bos``, if given).

    Streams ``n_segments`` segments of ``context`` tokens (cut as ``perplexity`` cuts them) through a cache that
    keeps every token and adds up the attention each key receives, over every query and query head. A token no
    query favours still gets some: with attention spread evenly, the query at position ``t`` gives the first token
    ``1 / (t + 1)`` of its weight (``uniform_first_token_share``). An attention sink, the first token soaking up
    the weight a head does not want to spend anywhere (StreamingLLM), takes many times that. Late queries say
    more than early ones, which have few other tokens to attend to.
    """
    tokens = _token_vector(tokens, "tokens")
    require_int("context", context, 2)
    require_int("n_segments", n_segments, 1)
    require_int("queries", queries, 1, context, note="context's last positions", or_none=True)
    queries = context if queries is None else queries
    _check_bos(bos, model)
    text_len = context - (bos is not None)
    if len(tokens) < n_segments * text_len:
        raise ValueError(
            f"n_segments: {n_segments} segments of {text_len} text tokens need {n_segments * text_len}; "
            f"allowed: at most {len(tokens) // text_len} for these {len(tokens)} tokens"
        )
    segments = _with_bos(tokens[: n_segments * text_len].view(n_segments, text_len), bos).to(model.device)
    # The one cache that records the attention each key receives; a budget of ``context`` evicts nothing.
    cache = HeavyHitterKVCache.for_model(model, n_segments, context, heavy=0, recent=context)
    layers = range(model.cfg.n_layers)
    first, before = context - queries, [(0.0, 0.0)] * model.cfg.n_layers
    if first:
        model.prefill(segments[:, :first], cache)
        before = [_first_and_total(cache, layer) for layer in layers]
    for t in range(first, context):
        model.decode_step(segments[:, t], cache)
    after = [_first_and_total(cache, layer) for layer in layers]
    return [(a[0] - b[0]) / (a[1] - b[1]) for a, b in zip(after, before, strict=True)]


def uniform_first_token_share(context: int, queries: int | None = None) -> float:
    """The first token's share of the attention of the last ``queries`` of ``context`` causal queries (default:
    all), if each spread its weight evenly: the mean of ``1 / (t + 1)`` over their positions ``t``."""
    require_int("context", context, 1)
    require_int("queries", queries, 1, context, note="context's last positions", or_none=True)
    queries = context if queries is None else queries
    return sum(1 / (t + 1) for t in range(context - queries, context)) / queries


def _first_and_total(cache: HeavyHitterKVCache, layer: int) -> tuple[float, float]:
    """Attention received so far by position 0, and by every key, in one layer, summed over sequences and heads."""
    received, positions = cache.attention_scores(layer), cache.kept_positions(layer)  # [B, Hkv, n] each
    return float(received[positions == 0].sum()), float(received.sum())


def _with_bos(rows: torch.Tensor, bos: int | None) -> torch.Tensor:
    """``rows`` ``[B, T]`` -> ``[B, T + 1]`` starting with ``bos``, or ``rows`` as they are without one."""
    if bos is None:
        return rows
    return torch.cat((torch.full((rows.shape[0], 1), bos, dtype=rows.dtype, device=rows.device), rows), dim=1)


def _check_bos(bos: object, model: Decoder) -> None:
    require_int("bos", bos, 0, model.cfg.vocab_size - 1, note="a token id", or_none=True)


def _final_probs(
    model: Decoder, prompts: torch.Tensor, make_cache: CacheFactory, prefill_tokens: int, bar: tqdm
) -> torch.Tensor:
    """``prompts`` ``[B, T]`` -> next-token probabilities after the last one, ``[B, V]`` float32 on the CPU."""
    prompts = prompts.to(model.device)
    cache = make_cache(model, prompts.shape[0], prompts.shape[1])
    last = deque(_stream(model, prompts, cache, prefill_tokens, bar), maxlen=1)[0]
    return torch.softmax(last.float(), dim=-1).cpu()


def _stream(
    model: Decoder, tokens: torch.Tensor, cache: KVCache, prefill_tokens: int, bar: tqdm, one_pass: bool = False
) -> Iterator[torch.Tensor]:
    """Feed ``tokens`` ``[B, T]``: prefill the first ``prefill_tokens``, then one decode step per token (with
    ``one_pass``, prefill them all).

    Yields next-token logits ``[B, V]`` after positions ``prefill_tokens-1, ..., T-1``; ``bar`` counts sequences
    times predictions.
    """
    if one_pass:
        logits = model.prefill(tokens, cache)
        for t in range(prefill_tokens - 1, tokens.shape[1]):
            yield logits[:, t]
            bar.update(tokens.shape[0])
        return
    yield model.prefill(tokens[:, :prefill_tokens], cache)[:, -1]
    bar.update(tokens.shape[0])
    for t in range(prefill_tokens, tokens.shape[1]):
        yield model.decode_step(tokens[:, t], cache)
        bar.update(tokens.shape[0])


def _bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="tok", disable=not enabled, leave=False)


def _token_vector(tokens: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    try:
        tokens = torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name}: not a sequence of token ids ({err}); allowed: a 1-D tensor or list of ints") from err
    if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(
            f"{name}: shape {tuple(tokens.shape)} dtype {tokens.dtype}; allowed: a 1-D tensor or list of int ids"
        )
    if len(tokens) == 0:
        raise ValueError(f"{name}: empty; allowed: at least one token")
    return tokens.long()


def _check_factory(make_cache: object) -> None:
    if not callable(make_cache):
        raise ValueError(f"make_cache: {make_cache!r} is not callable; allowed: make_cache(model, batch, capacity)")


def _nonempty(name: str, values: Sequence) -> list:
    values = [values] if isinstance(values, (int, float)) else list(values)
    if not values:
        raise ValueError(f"{name}: empty; allowed: at least one value")
    return values
