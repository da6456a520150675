"""Lesson 10, speculative decoding: the greedy acceptance rule, the expected tokens per verify step, the per-draft
acceptance estimated from counts, the byte model's bytes per token and speedup, the speedup refined by the verify
step's measured cost against its number of positions, and a real target/draft pair on a GPU's roofline against
batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from kvlab.course.grading import call_learner, close_to, config_label, fail, is_int, is_real
from kvlab.engine.speculative import SpeculativeResult, accept_greedy
from kvlab.roofline import (
    decode_flops,
    expected_tokens_per_step,
    kv_bytes_per_step,
    predict_speculative,
    roofline_time_ms,
    weight_bytes_read,
)
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import GPU, get_gpu, get_model

__all__ = [
    "check_accept_greedy",
    "check_acceptance_estimate",
    "check_byte_speedup",
    "check_expected_tokens",
    "check_refined_speedup",
    "check_spec_roofline",
]


# -- exercise 1: the greedy acceptance rule ---------------------------------------------------------------------------
def _accept_case(
    vocab: int, k: int, n_match: int, seed: int, match_after: bool = False, tie: bool = False
) -> tuple[torch.Tensor, list[int]]:
    """Logits ``[k + 1, vocab]`` and ``k`` drafts whose first ``n_match`` equal the rows' argmax (then a wrong one).

    ``match_after``: the drafts after the first wrong one equal their rows' argmax again (a rule that counts every
    match, not the run up to the first mismatch, keeps them). ``tie``: the first wrong draft's row has two equal
    maxima and the draft is the second of them (kvlab's rule, torch's argmax, takes the first)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=gen) * 3
    best = logits.argmax(-1).tolist()
    drafts = list(best[:k])
    if n_match < k:
        wrong = (best[n_match] + 1 + int(torch.randint(vocab - 1, (), generator=gen))) % vocab
        if tie:
            low, high = sorted((best[n_match], wrong))
            logits[n_match, [low, high]] = logits[n_match].max()  # two maxima: the argmax is the lower id
            wrong = high
        drafts[n_match] = wrong
        if not match_after:
            for i in range(n_match + 1, k):
                drafts[i] = (best[i] + 1) % vocab
    return logits, drafts


_ACCEPT_CASES = (
    (50, 4, 4, 1),  # every draft kept: the bonus token comes from the last row
    (50, 4, 0, 2),  # the first draft rejected
    (50, 5, 2, 3, True),  # rejected in the middle, later drafts right again: they do not count
    (50, 0, 0, 4),  # no drafts: the step is a plain decode step
    (20, 3, 1, 5, False, True),  # a tie at the rejection: the argmax is the first maximal id
)
_ACCEPT_FIX = (
    "Not what section 1's greedy rule (exercise 1's text) yields: check where it stops, what n_accepted counts, "
    "and which row of logits gives next_token, both when a draft is rejected and when every draft is kept."
)


def check_accept_greedy(
    fn: Callable[[torch.Tensor, list[int]], tuple[int, int]],
    cases: Iterable[tuple] = _ACCEPT_CASES,
    reveal: bool = True,
) -> None:
    """``fn(logits, drafts)`` -> ``(n_accepted, next_token)``, both ints: greedy verification of ``k`` drafts.

    ``logits``: the target's ``[k + 1, V]`` predictions, row ``i`` after the pending token and drafts ``0 .. i-1``.
    Compared with kvlab's own rule (``kvlab.engine.speculative.accept_greedy``) on each case ``(vocab, k,
    n_match, seed[, match_after[, tie]])``.
    """
    for case in cases:
        logits, drafts = _accept_case(*case)
        want_n, want_next = accept_greedy(logits, drafts)
        label = f"accept_greedy(logits {tuple(logits.shape)}, drafts {drafts})"
        got = call_learner(label, fn, logits.clone(), list(drafts))
        if not (isinstance(got, Sequence) and len(got) == 2):
            fail(label, got, "a tuple (n_accepted, next_token)", "Return the two ints.")
        for name, value in zip(("n_accepted", "next_token"), got, strict=True):
            if not is_int(value):
                fail(f"{label} {name}", value, f"a Python int, not a {type(value).__name__}", "Use int(...).")
        n, nxt = got
        best = logits.argmax(-1).tolist()
        if n != want_n:
            slip = ""
            tied = want_n < len(drafts) and bool(logits[want_n, drafts[want_n]] == logits[want_n].max())
            if reveal and tied and n > want_n:
                slip = (
                    f" Row {want_n} has a tie: draft {drafts[want_n]} has the largest logit, but so does a lower id, "
                    "and argmax (torch's, on a tie) picks the lowest id. Compare the draft's id with the argmax, not "
                    "its logit with the maximum."
                )
            elif reveal and n == sum(d == b for d, b in zip(drafts, best, strict=False)):
                slip = " It counts every draft equal to its row's argmax: stop at the first one that differs."
            elif reveal and n == want_n + 1:
                slip = " It is one too many: the first draft that differs is rejected, not kept."
            fail(f"{label} n_accepted", n, "number of drafts kept", _ACCEPT_FIX + slip, want_n, reveal)
        if nxt != want_next:
            slip = ""
            if reveal and want_n > 0 and nxt == best[want_n - 1]:
                slip = " It is the argmax of row n_accepted - 1: row i predicts the token at draft position i."
            elif reveal and want_n < len(drafts) and nxt == drafts[want_n]:
                slip = " It is the rejected draft itself: the target's own choice replaces it."
            fail(f"{label} next_token", nxt, "token id", _ACCEPT_FIX + slip, want_next, reveal)


# -- exercise 2: expected tokens per verify step ----------------------------------------------------------------------
_TOKENS_CASES = ((0.8, 4), (0.6, 1), (0.9, 8), (0.0, 3), (1.0, 5), (0.7, 0))


def check_expected_tokens(
    fn: Callable[[float, int], float], cases: Iterable[tuple[float, int]] = _TOKENS_CASES, reveal: bool = True
) -> None:
    """``fn(a, k)`` -> expected tokens per verify step, ``1 + a + ... + a^k``, compared with
    ``kvlab.roofline.expected_tokens_per_step``. Includes ``a = 0``, ``a = 1`` (``k + 1``, no division) and
    ``k = 0`` (1)."""
    for a, k in cases:
        label = f"expected_tokens(a={a}, k={k})"
        fix = "Not the expected tokens section 2 derives: draft i is kept only if every draft before it was."
        try:
            got = call_learner(label, fn, a, k)
        except AssertionError as e:
            if a == 1:
                raise AssertionError(
                    f"{e}. At a = 1 the closed form is 0 / 0: every draft is kept, k + 1 tokens."
                ) from e
            raise
        want = expected_tokens_per_step(a, k)
        slips = (
            (want - 1, "It leaves out the target's own token: every step adds one after the accepted drafts."),
            (1 + k * a, "It is 1 + k a: draft i survives only if every draft before it did, so a^i, not a."),
            (want - a**k, "It stops at a^(k-1): there are k drafts, so the sum runs to a^k."),
        )
        close_to(label, got, want, "tokens per step", fix, reveal, slips=slips if a not in (0, 1) and k else ())


# -- exercise 3: the per-draft acceptance from counts -----------------------------------------------------------------
_ESTIMATE_CASES = (
    ((4, 1, 4, 0, 2), (4, 4, 4, 4, 4)),
    ((2, 2, 2, 1), (2, 2, 2, 2)),  # every draft but one kept
    ((3, 0, 3, 1, 0), (3, 3, 3, 3, 0)),  # the last step drafted nothing (one token was left): no rejection
    ((1, 1, 1), (1, 1, 1)),  # no rejection at all: a = 1
    ((5, 2, 3, 1), (8, 8, 3, 1)),  # the last steps drafted fewer than k, and kept them all
)


def _result(accepted: Sequence[int], proposed: Sequence[int]) -> SpeculativeResult:
    """A ``SpeculativeResult`` with only the counts (what ``acceptance_per_draft`` reads)."""
    n_tokens = sum(accepted) + len(accepted)
    return SpeculativeResult(
        tokens=torch.zeros(n_tokens, dtype=torch.long),
        proposed=sum(proposed),
        accepted=sum(accepted),
        verify_steps=len(accepted),
        draft_steps=0,
        verify_kv_bytes=0,
        proposed_per_step=tuple(proposed),
        accepted_per_step=tuple(accepted),
    )


def check_acceptance_estimate(
    fn: Callable[[Sequence[int], Sequence[int]], float],
    results: Iterable[SpeculativeResult] = (),
    cases: Iterable[tuple[Sequence[int], Sequence[int]]] = _ESTIMATE_CASES,
    reveal: bool = True,
) -> None:
    """``fn(accepted_per_step, proposed_per_step)`` -> the per-draft acceptance ``a``: accepted / (accepted +
    rejections), a rejection being a step that kept fewer drafts than it was offered.

    Compared with ``SpeculativeResult.acceptance_per_draft`` on the fabricated ``cases`` and on ``results``, your
    own runs (consistency with your data, no band: these counts are deterministic).
    """
    own = [(r.accepted_per_step, r.proposed_per_step) for r in results]
    for accepted, proposed in [*own, *cases]:
        ref = _result(accepted, proposed)
        if not ref.accepted + ref.rejections:
            continue
        label = f"acceptance_estimate({list(accepted)[:8]}{'...' if len(accepted) > 8 else ''}, ...)"
        got = call_learner(label, fn, list(accepted), list(proposed))
        k = max(proposed)
        short = sum(a < k for a in accepted)
        slips = (
            (ref.acceptance_rate, "That is accepted / drafted (the acceptance rate servers report), not a."),
            (
                ref.accepted / (ref.accepted + short) if ref.accepted + short else math.nan,
                "It counts a step as a rejection when it kept fewer than k; compare with what the step was offered "
                "(the last steps are offered fewer drafts).",
            ),
        )
        fix = "Not the per-draft a exercise 3 (section 3) defines: each rejection is one draft judged and refused."
        close_to(label, got, ref.acceptance_per_draft, "acceptance (a fraction)", fix, reveal, rel=1e-9, slips=slips)


# -- exercise 4: the byte model ---------------------------------------------------------------------------------------
_BYTES_CASES = (
    (205_000_000, 1_320_000, 4, 0.8),
    (56_000_000, 0, 3, 0.65),  # prompt lookup: no draft bytes
    (141_000_000_000, 16_000_000_000, 15, 0.92),
    (10_000_000, 2_000_000, 1, 0.0),
    (10_000_000, 2_000_000, 6, 1.0),
)


def check_byte_speedup(
    fn: Callable[[int, int, int, float], tuple[float, float]],
    cases: Iterable[tuple[int, int, int, float]] = _BYTES_CASES,
    reveal: bool = True,
) -> None:
    """``fn(target_bytes, draft_bytes, k, a)`` -> ``(bytes_per_token, speedup)`` of the byte model, compared with
    ``kvlab.roofline.predict_speculative``: a round reads the target's bytes once and the draft's ``k`` times, and
    yields ``expected_tokens(a, k)`` tokens; the speedup is plain decoding's bytes per token over that."""
    for target, draft, k, a in cases:
        label = f"byte_speedup(target_bytes={target:,}, draft_bytes={draft:,}, k={k}, a={a})"
        got = call_learner(label, fn, target, draft, k, a)
        if not (isinstance(got, Sequence) and len(got) == 2):
            fail(label, got, "a tuple (bytes_per_token, speedup)", "Return the two numbers.")
        ref = predict_speculative(target, k, a, 1.0, draft)
        tokens = ref.tokens_per_step
        fix = "Not the bytes per token exercise 4 (section 4) defines: check what a round reads, and what it yields."
        slips = (
            ((target + draft) / tokens, "It counts the draft once per round: a round runs k draft steps."),
            (target / tokens, "It leaves out the draft's bytes: each of the k draft steps reads them."),
            (ref.bytes_per_round / (k + 1), "It divides by k + 1, as if every draft were kept: use expected tokens."),
        )
        close_to(f"{label} bytes_per_token", got[0], ref.bytes_per_token, "bytes", fix, reveal, slips=slips)
        fix = "Not the speedup exercise 4 (section 4) defines: compare with plain decoding's bytes per token."
        close_to(
            f"{label} speedup",
            got[1],
            ref.speedup,
            "x (a ratio)",
            fix,
            reveal,
            slips=((1 / ref.speedup, "It is inverted."),),
        )


# -- exercise 5: the speedup from the measured verify cost -------------------------------------------------------------
def _refined_speedup(a: float, k: int, verify_ms: Mapping[int, float], draft_ms: float) -> float:
    """The lesson's refined model: ``expected_tokens(a, k) x T(1) / (T(k + 1) + k x draft_ms)``, with ``T(n) =
    verify_ms[n]`` the target's step over ``n`` positions and ``draft_ms`` one draft step."""
    return expected_tokens_per_step(a, k) * verify_ms[1] / (verify_ms[k + 1] + k * draft_ms)


_VERIFY_A = {1: 6.0, 2: 9.0, 3: 11.1, 4: 12.7, 5: 14.2, 6: 15.9, 7: 15.8, 8: 16.7, 9: 16.9}  # a CPU's shape
_VERIFY_FLAT = {n: 10.0 + 0.05 * n for n in range(1, 17)}  # a GPU-like verify step
_REFINED_CASES = (
    (0.8, 4, _VERIFY_A, 0.8),
    (0.65, 1, _VERIFY_A, 0.0),
    (0.9, 8, _VERIFY_A, 0.5),
    (0.92, 15, _VERIFY_FLAT, 1.2),
)


def check_refined_speedup(
    fn: Callable[[float, int, Mapping[int, float], float], float],
    own: Iterable[tuple[float, int, Mapping[int, float], float]] = (),
    cases: Iterable[tuple[float, int, Mapping[int, float], float]] = _REFINED_CASES,
    reveal: bool = True,
) -> None:
    """``fn(a, k, verify_ms, draft_ms)`` -> predicted speedup = expected_tokens(a, k) x T(1) / (T(k + 1) + k x
    draft_ms), where ``verify_ms[n]`` is the target's step over ``n`` positions. Checked on fabricated ``cases``
    and on ``own``: your measurements, as ``(a, k, verify_ms, draft_ms)`` (consistency, no band)."""
    for a, k, verify, draft in [*own, *cases]:
        label = f"refined_speedup(a={a:.4g}, k={k}, verify_ms={{1: {verify[1]:.4g}, ...}}, draft_ms={draft:.4g})"
        got = call_learner(label, fn, a, k, dict(verify), draft)
        want = _refined_speedup(a, k, verify, draft)
        tokens = expected_tokens_per_step(a, k)
        slips = (
            (tokens * verify[1] / (verify[1] + k * draft), "It charges the verify step T(1): use T(k + 1), measured."),
            (tokens * verify[1] / verify[k + 1], "It leaves out the k draft steps' time."),
            (tokens * verify[1] / (verify[k + 1] + draft), "It charges one draft step per round: there are k."),
            (tokens * verify[1] / (verify[k] + k * draft), "It uses T(k): a verify step runs k + 1 positions."),
        )
        fix = "Not the speedup exercise 5 (section 5) defines: check what a round costs, and its tokens."
        close_to(label, got, want, "x (a ratio)", fix, reveal, rel=1e-9, slips=slips)


# -- exercise 6: a real pair on a GPU's roofline, against batch --------------------------------------------------------
def _step_ms(cfg: ModelConfig, gpu: GPU, batch: int, context: int, positions: int, weights_batch: int) -> float:
    """One step of ``batch`` sequences at ``context`` tokens over ``positions`` positions, on ``gpu``'s roofline
    (dense bf16 peak, nominal bandwidth); the weights read as by a batch of ``weights_batch``."""
    n_bytes = weight_bytes_read(cfg, batch=weights_batch) + kv_bytes_per_step(cfg, context, batch)
    return roofline_time_ms(decode_flops(cfg, context, positions), n_bytes, gpu.bf16_tflops * 1e12, gpu.bandwidth_gbps)


def _roofline_steps(
    target: ModelConfig, draft: ModelConfig, gpu: GPU, batch: int, context: int, k: int
) -> tuple[float, float, float]:
    """(plain step, verify step, draft step) in ms for ``batch`` sequences at ``context`` tokens. Each step reads
    ``weight_bytes_read(cfg, batch=batch) + kv_bytes_per_step(cfg, context, batch)``; the verify step does the FLOPs
    of ``batch x (k + 1)`` positions."""
    return (
        _step_ms(target, gpu, batch, context, batch, batch),
        _step_ms(target, gpu, batch, context, batch * (k + 1), batch),
        _step_ms(draft, gpu, batch, context, batch, batch),
    )


_ROOFLINE_CASES = (
    ("llama-3.1-70b", "llama-3.1-8b", "h100-sxm", 1, 4096, 4, 0.8),
    ("llama-3.1-70b", "llama-3.1-8b", "h100-sxm", 64, 4096, 4, 0.8),
    ("llama-3.1-70b", "llama-3.1-8b", "h100-sxm", 256, 512, 4, 0.8),  # the verify step compute-bound
    ("llama-3.1-70b", "llama-3.1-8b", "mi300x", 8, 2048, 15, 0.92),
)


def check_spec_roofline(
    fn: Callable[[ModelConfig, ModelConfig, GPU, int, int, int, float], tuple[float, float]],
    cases: Iterable[tuple[Any, ...]] = _ROOFLINE_CASES,
    reveal: bool = True,
) -> None:
    """``fn(target, draft, gpu, batch, context, k, a)`` -> ``(plain_ms, spec_ms)``: ms per generated token of each
    sequence on the GPU's roofline. Plain: one target step. Speculative: a verify step (the plain step's bytes,
    ``batch x (k + 1)`` positions' FLOPs) plus ``k`` draft steps, over ``expected_tokens_per_step(a, k)``. Cases
    name presets (or pass configs and GPUs): ``(target, draft, gpu, batch, context, k, a)``."""
    for target, draft, gpu, batch, context, k, a in cases:
        target = get_model(target) if isinstance(target, str) else target
        draft = get_model(draft) if isinstance(draft, str) else draft
        gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        label = (
            f"spec_roofline({config_label(target)}, {draft.name}, {gpu.name}, batch={batch}, context={context}, k={k})"
        )
        got = call_learner(label, fn, target, draft, gpu, batch, context, k, a)
        if not (isinstance(got, Sequence) and len(got) == 2 and all(is_real(x) for x in got)):
            fail(label, got, "a tuple of two numbers (plain_ms, spec_ms)", "Return the two times in ms.")
        plain, verify, one_draft = _roofline_steps(target, draft, gpu, batch, context, k)
        tokens = expected_tokens_per_step(a, k)
        fix = (
            "Each step is timed on the roofline with the kvlab functions exercise 6's text (section 6) names: check "
            "its FLOPs, its bytes for this batch and context, and the GPU's units."
        )
        unbatched = (
            _step_ms(target, gpu, batch, context, batch, 1),
            "It reads the weights as a batch of 1 does: pass batch=batch to weight_bytes_read (each sequence reads "
            "its own rows of an untied input embedding).",
        )
        close_to(
            f"{label} plain_ms",
            got[0],
            plain,
            "ms",
            "Plain: one target step for the batch. " + fix,
            reveal,
            slips=(unbatched,) if unbatched[0] != plain else (),
        )
        slips = (
            (
                (plain + k * one_draft) / tokens,
                "The verify step does the FLOPs of batch x (k + 1) positions (decode_flops(target, context, "
                "batch * (k + 1))), not batch: that is what makes a large batch compute-bound.",
            ),
            (verify / tokens, "It leaves out the k draft steps."),
            (verify + k * one_draft, "It is the time per round: divide by expected_tokens(a, k)."),
            ((verify + k * one_draft) / (k + 1), "It divides by k + 1: use expected_tokens(a, k)."),
        )
        fix = "Speculative: check what a round runs, and how many tokens it yields. " + fix
        close_to(f"{label} spec_ms", got[1], (verify + k * one_draft) / tokens, "ms", fix, reveal, slips=slips)
