"""Speculative decoding: draft several tokens cheaply, then let the target check them all in one step.

A decode step at batch 1 streams every weight of the target to produce one token. A verify step streams them once
for ``k + 1`` positions: the last token the target has not seen yet, and ``k`` tokens a drafter guessed after it.
The target keeps the drafted tokens its own rule would have produced, and adds one of its own (the first
correction, or a bonus token when every draft was right). So every verify step yields between 1 and ``k + 1``
tokens for one pass over the weights.

Drafters:

- a smaller ``Decoder`` with the target's vocabulary: ``k`` cheap decode steps per round;
- ``"prompt-lookup"``: no model. Find the latest earlier occurrence of the context's last n-gram (the longest of
  ``PROMPT_LOOKUP_NGRAMS`` that occurs) and propose the tokens that followed it. Code and chat repeat themselves,
  so this costs nothing and is often right.

Acceptance:

- greedy (``temperature=0``): a draft is kept while it equals the target's argmax; the output is the target's own
  greedy output, token for token, whatever the drafter proposes.
- sampling: draft ``x`` (drawn from the drafter's ``q``) is kept with probability ``min(1, p(x) / q(x))``; the first
  rejection draws from ``max(0, p - q)``, normalised. Every token is then distributed exactly as the target alone
  would sample it (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318). Prompt lookup is
  a drafter whose ``q`` is all on its guess.

Rollback: the verify step stores K/V for every drafted token; ``KVCache.truncate`` then forgets the rejected ones,
and the drafter's cache forgets what the target rejected. A cache that cannot roll back (a window, heavy hitters)
is refused before anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from kvlab.cache.base import ROLLBACK_CACHES, CacheFactory, CacheRollbackError, KVCache, default_cache
from kvlab.machine.timing import time_interleaved
from kvlab.model.decoder import Decoder
from kvlab.spec.validation import require_int, require_number

PROMPT_LOOKUP = "prompt-lookup"
PROMPT_LOOKUP_NGRAMS = (3, 2, 1)  # tried longest first: a longer match predicts the continuation better


@dataclass(frozen=True)
class SpeculativeResult:
    """What ``speculative_generate`` produced and how.

    ``tokens``: the new ids, ``[max_new_tokens]``. ``proposed``/``accepted``: drafted tokens offered / kept.
    ``verify_steps``: target forward passes after the prompt (each streams the weights once). ``draft_steps``:
    drafter forward passes (0 for prompt lookup). ``verify_kv_bytes``: K/V bytes the verify steps read, each
    counted once at the length it attended over (what ``bytes_read_per_step`` reports for that length).
    ``proposed_per_step``/``accepted_per_step``: how many drafts each verify step was offered and kept, in order.
    """

    tokens: torch.Tensor
    proposed: int
    accepted: int
    verify_steps: int
    draft_steps: int
    verify_kv_bytes: int
    proposed_per_step: tuple[int, ...] = field(repr=False)
    accepted_per_step: tuple[int, ...] = field(repr=False)

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target kept (``nan`` when nothing was drafted)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def acceptance_per_draft(self) -> float:
        """The ``a`` of ``kvlab.roofline.expected_tokens_per_step``: the chance a draft is accepted once the ones
        before it were. Each rejection ends a step's run of accepted drafts, so ``accepted / (accepted +
        rejections)`` estimates it. It exceeds ``acceptance_rate`` when a step's later drafts go unjudged after a
        rejection, and real drafts are easier in some stretches than others, which the model's one ``a`` ignores.
        """
        judged = self.accepted + self.rejections
        return self.accepted / judged if judged else float("nan")

    @property
    def rejections(self) -> int:
        """Verify steps that rejected a draft (the others kept every draft they were offered)."""
        return sum(a < p for a, p in zip(self.accepted_per_step, self.proposed_per_step, strict=True))

    @property
    def tokens_per_step(self) -> float:
        """New tokens per verify step: plain decoding makes 1."""
        return len(self.tokens) / self.verify_steps if self.verify_steps else float("nan")


def speculative_generate(
    target: Decoder,
    prompt: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    draft: Decoder | str,
    k: int = 4,
    temperature: float = 0.0,
    seed: int | None = None,
    make_cache: CacheFactory = default_cache,
    make_draft_cache: CacheFactory = default_cache,
) -> SpeculativeResult:
    """Continue ``prompt`` (``[T]`` or ``[1, T]``) by ``max_new_tokens`` with the target, drafting ``k`` at a time.

    ``draft``: a ``Decoder`` sharing the target's vocabulary, or ``"prompt-lookup"``. ``temperature=0`` is greedy
    (the output equals ``target.generate(prompt, max_new_tokens)``); above 0, speculative sampling with ``seed``.
    ``make_cache``/``make_draft_cache``: how to build each model's cache (``make_cache(model, 1, capacity)``); it
    must be able to roll back ``k + 1`` tokens.
    """
    prompt = _prompt(prompt, target)
    require_int("max_new_tokens", max_new_tokens, 0)
    require_int("k", k, 0)
    require_number("temperature", temperature, 0, note="0 is greedy")
    drafter = _drafter(draft, target, make_draft_cache, len(prompt) + max_new_tokens + k + 1, k)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = make_cache(target, 1, len(prompt) + max_new_tokens + k + 1)
    _require_rollback(cache, "make_cache", k)

    # The target's cache holds every token but the newest, ``pending``: the next verify step starts with it.
    if len(prompt) > 1:
        target.prefill(prompt[None, :-1].to(target.device), cache)
    context, pending = prompt[:-1].tolist(), int(prompt[-1])
    out: list[int] = []
    verify_kv_bytes = 0
    proposed_per_step: list[int] = []
    accepted_per_step: list[int] = []
    while len(out) < max_new_tokens:
        n_draft = min(k, max_new_tokens - len(out) - 1)  # a step yields up to n_draft + 1 tokens
        drafts, q = drafter.propose(context, pending, n_draft, temperature, gen)
        step = torch.tensor([[pending, *drafts]], device=target.device)
        logits = target.prefill(step, cache)[0].float()  # [1 + len(drafts), V]: p for each position
        verify_kv_bytes += cache.bytes_read_per_step(cache.length)
        n_ok, extra = _accept(logits, drafts, q, temperature, gen)
        proposed_per_step.append(len(drafts))
        accepted_per_step.append(n_ok)
        cache.truncate(cache.length - (len(drafts) - n_ok))
        drafter.keep(len(context) + 1 + n_ok)
        context += [pending, *drafts[:n_ok]]
        out += [*drafts[:n_ok], extra]
        pending = extra
    return SpeculativeResult(
        tokens=torch.tensor(out, dtype=torch.long),
        proposed=sum(proposed_per_step),
        accepted=sum(accepted_per_step),
        verify_steps=len(accepted_per_step),
        draft_steps=drafter.steps,
        verify_kv_bytes=verify_kv_bytes,
        proposed_per_step=tuple(proposed_per_step),
        accepted_per_step=tuple(accepted_per_step),
    )


def accept_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> tuple[int, int]:
    """Greedy verification: how many ``drafts`` the target keeps, and the token it adds after them.

    ``logits``: ``[n + 1, V]``, the target's prediction at each drafted position and after the last. Drafts are
    kept while each equals the argmax of its row; the added token is the argmax of the row after the last kept
    draft (the correction, or a bonus token when all were kept). Ties go to the lowest id, as ``argmax`` breaks
    them, so the output is the target's own greedy output.
    """
    best = logits.argmax(dim=-1).tolist()
    n_ok = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
    return n_ok, best[n_ok]


def _accept(
    logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, temperature: float, gen: torch.Generator | None
) -> tuple[int, int]:
    """How many ``drafts`` the target keeps, and the token it adds after them (``accept_greedy`` at temperature 0).

    ``logits``: ``[n + 1, V]``, the target's prediction at each drafted position and after the last.
    ``q``: the drafter's probabilities for each draft, ``[n, V]`` (``None``: the drafts were certain guesses).
    """
    if temperature == 0:
        return accept_greedy(logits, drafts)
    p = torch.softmax(logits / temperature, dim=-1)
    for i, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[i, d])
        if float(torch.rand((), generator=gen)) * q_d < float(p[i, d]):  # accept with probability min(1, p/q)
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        if not float(residual.sum()) > 0:  # p == q up to rounding: rejection had probability ~0; p is the answer
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


class _ModelDrafter:
    """A small model drafting token by token, its cache kept in step with the accepted context."""

    def __init__(self, model: Decoder, make_cache: CacheFactory, capacity: int, k: int) -> None:
        self.model, self.steps = model, 0
        self.cache = make_cache(model, 1, capacity)
        _require_rollback(self.cache, "make_draft_cache", k)

    def propose(
        self, context: list[int], pending: int, n: int, temperature: float, gen: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        if n == 0:
            return [], None
        # Catch up on what the target accepted since (a bonus token's predecessor, the prompt), in one pass.
        missing = [*context[self.cache.length :], pending]
        logits = self.model.prefill(torch.tensor([missing], device=self.model.device), self.cache)[0, -1]
        self.steps += 1
        drafts, probs = [], []
        for i in range(n):
            logits = logits.float()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs.append(torch.softmax(logits / temperature, dim=-1))
                token = int(torch.multinomial(probs[-1], 1, generator=gen))
            drafts.append(token)
            if i + 1 < n:
                logits = self.model.decode_step(torch.tensor([token], device=self.model.device), self.cache)[0]
                self.steps += 1
        return drafts, torch.stack(probs) if probs else None

    def keep(self, length: int) -> None:
        self.cache.truncate(min(length, self.cache.length))


class _PromptLookup:
    """Drafts by copying what followed the latest earlier occurrence of the context's last n-gram."""

    steps = 0

    def propose(
        self, context: list[int], pending: int, n: int, temperature: float, gen: torch.Generator | None
    ) -> tuple[list[int], None]:
        return prompt_lookup([*context, pending], n), None

    def keep(self, length: int) -> None:
        pass


def prompt_lookup(tokens: Sequence[int], n: int, ngrams: Sequence[int] = PROMPT_LOOKUP_NGRAMS) -> list[int]:
    """Up to ``n`` tokens that followed the latest earlier occurrence of ``tokens``' last n-gram, trying the
    n-gram sizes in ``ngrams`` in order; ``[]`` when none occurs earlier."""
    tokens = list(tokens)
    for size in ngrams:
        if size >= len(tokens):
            continue
        tail = tokens[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):  # latest first: recent text predicts best
            if tokens[start : start + size] == tail:
                return tokens[start + size : start + size + n]
    return []


@torch.no_grad()
def time_verify_steps(
    model: Decoder,
    prompt: torch.Tensor | Sequence[int],
    positions: Sequence[int],
    repeats: int = 5,
    make_cache: CacheFactory = default_cache,
) -> dict[int, list[float]]:
    """Seconds of one ``model`` call over ``n`` new positions after ``prompt`` (``[T]``), for each ``n`` in
    ``positions``: ``repeats`` times each, taken in turns (``kvlab.machine.timing.time_interleaved``), the cache rolled
    back to the prompt after every call.

    ``n = 1`` is a plain decode step; ``n = k + 1`` is a verify step of ``k`` drafts. The byte model says the two
    cost the same while the step is bandwidth-bound; this measures whether they do on this machine.
    """
    prompt = _prompt(prompt, model)
    if not positions or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in positions):
        raise ValueError(f"positions: {list(positions)!r}; allowed: a non-empty list of integers >= 1")
    require_int("repeats", repeats)
    cache = make_cache(model, 1, len(prompt) + max(positions))
    model.prefill(prompt[None].to(model.device), cache)
    new = prompt[-1:].repeat(max(positions))[None].to(model.device)  # the ids do not change the work

    def call(n: int) -> None:
        model.prefill(new[:, :n], cache)
        cache.truncate(len(prompt))

    return time_interleaved({n: partial(call, n) for n in positions}, repeats, device=model.device)


@torch.no_grad()
def inflate_mlp(model: Decoder, d_ff: int) -> Decoder:
    """A copy of ``model`` whose every MLP has ``d_ff`` hidden units: its own, then units whose weights are all 0.

    The extra units output ``silu(0) * 0 = 0`` through zero rows of the down projection, so the copy predicts what
    ``model`` predicts (to float rounding: the matmuls sum over more terms, in another order) while each decode
    step streams the bigger matrices. What it is for: a small trained model fits in a laptop CPU's last-level
    cache, where a decode step is not bandwidth-bound; inflated past the cache, it decodes like a real target that
    streams its weights from memory, and a draft trained beside the small model still agrees with it as often.
    Dense MLPs only (MoE configurations are refused).
    """
    cfg = model.cfg
    if cfg.moe is not None:
        raise ValueError(f"model: {cfg.name} has MoE layers; allowed: a dense model")
    require_int("d_ff", d_ff, cfg.d_ff)
    big = Decoder(cfg.replace(d_ff=d_ff, name=f"{cfg.name}-ff{d_ff}"), device=model.device, seed=None)
    own = {n: p for n, p in model.named_parameters()}
    for name, p in big.named_parameters():
        if name.endswith("mlp.w_gate_up"):
            gate, up = own[name].chunk(2, dim=-1)
            p.zero_()
            p[:, : cfg.d_ff] = gate
            p[:, d_ff : d_ff + cfg.d_ff] = up
        elif name.endswith("mlp.w_down"):
            p.zero_()
            p[: cfg.d_ff] = own[name]
        else:
            p.copy_(own[name])
    return big


def _drafter(
    draft: Decoder | str, target: Decoder, make_cache: CacheFactory, capacity: int, k: int
) -> _ModelDrafter | _PromptLookup:
    if isinstance(draft, Decoder):
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"draft: vocab_size {draft.cfg.vocab_size}; allowed: the target's vocabulary "
                f"({target.cfg.vocab_size} ids), since drafted ids go to the target as they are"
            )
        return _ModelDrafter(draft, make_cache, capacity, k)
    if draft == PROMPT_LOOKUP:
        return _PromptLookup()
    raise ValueError(f"draft: {draft!r}; allowed: a kvlab Decoder (a smaller model), or {PROMPT_LOOKUP!r}")


def _require_rollback(cache: KVCache, name: str, k: int) -> None:
    """Refuse, before anything runs, a cache that could not forget ``k`` rejected drafts."""
    if not cache.can_roll_back(k):
        raise CacheRollbackError(
            f"{name}: {type(cache).__name__} cannot roll back {k} tokens ({cache._no_rollback}), and speculative "
            f"decoding forgets up to k={k} rejected drafts per step; allowed: {ROLLBACK_CACHES}"
        )


def _prompt(prompt: torch.Tensor | Sequence[int], target: Decoder) -> torch.Tensor:
    prompt = torch.as_tensor(prompt, dtype=torch.long).cpu()
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1 or len(prompt) == 0:
        raise ValueError(
            f"prompt: shape {tuple(prompt.shape)}; allowed: one sequence, [T] or [1, T] with T >= 1 "
            "(speculative_generate runs batch 1, where decoding is most memory-bound)"
        )
    if int(prompt.min()) < 0 or int(prompt.max()) >= target.cfg.vocab_size:
        raise ValueError(f"prompt: ids outside [0, {target.cfg.vocab_size}); allowed: the target's vocabulary")
    return prompt
