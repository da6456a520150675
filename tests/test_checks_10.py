"""Lesson 10's checkers (speculative decoding): a right answer passes silently, a likely wrong one fails with a
message that names the fix, and hidden checks withhold the expected value. Every check here is exact arithmetic
or consistency with the learner's own counts and timings, passed in as fabricated data, so nothing here is timed."""

from __future__ import annotations

import pytest
import torch

from autograde import hidden
from kvlab import checks, get_gpu, get_model, roofline
from kvlab.course import lesson10_speculative_decoding as lesson10
from kvlab.engine.speculative import PROMPT_LOOKUP, speculative_generate
from tests.helpers import assert_fails, assert_silent, sharp_random_model


# -- reference answers, written the way a learner would -------------------------------------------------------------
def accept_greedy(logits, drafts):
    best = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def expected_tokens(a, k):
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def acceptance_estimate(accepted_per_step, proposed_per_step):
    accepted = sum(accepted_per_step)
    rejections = sum(a < p for a, p in zip(accepted_per_step, proposed_per_step, strict=True))
    return accepted / (accepted + rejections)


def byte_speedup(target_bytes, draft_bytes, k, a):
    per_token = (target_bytes + k * draft_bytes) / expected_tokens(a, k)
    return per_token, target_bytes / per_token


def refined_speedup(a, k, verify_ms, draft_ms):
    return expected_tokens(a, k) * verify_ms[1] / (verify_ms[k + 1] + k * draft_ms)


def spec_roofline(target, draft, gpu, batch, context, k, a, verify_positions=None, per_round=False):
    peak = gpu.bf16_tflops * 1e12

    def step(cfg, positions):
        n_bytes = roofline.weight_bytes_read(cfg, batch=batch) + roofline.kv_bytes_per_step(cfg, context, batch)
        return roofline.roofline_time_ms(
            roofline.decode_flops(cfg, context, positions), n_bytes, peak, gpu.bandwidth_gbps
        )

    verify = step(target, batch * (k + 1) if verify_positions is None else verify_positions)
    round_ms = verify + k * step(draft, batch)
    return step(target, batch), round_ms if per_round else round_ms / expected_tokens(a, k)


# -- every checker passes a right answer silently, public and hidden --------------------------------------------------
RIGHT = {
    "check_accept_greedy": accept_greedy,
    "check_expected_tokens": expected_tokens,
    "check_acceptance_estimate": acceptance_estimate,
    "check_byte_speedup": byte_speedup,
    "check_refined_speedup": refined_speedup,
    "check_spec_roofline": spec_roofline,
}


@pytest.mark.parametrize("name", sorted(RIGHT))
def test_right_answers_pass_silently(capsys, name):
    assert_silent(capsys, getattr(checks, name), RIGHT[name])
    assert_silent(capsys, getattr(hidden, name), RIGHT[name])


def test_the_checkers_are_exported():
    for name in RIGHT:
        assert getattr(checks, name) is getattr(lesson10, name)


def test_acceptance_estimate_is_checked_against_real_runs(capsys):
    model = sharp_random_model(23, seed=3)
    prompt = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    results = [speculative_generate(model, prompt, 20, draft=PROMPT_LOOKUP, k=k) for k in (1, 3)]
    assert_silent(capsys, checks.check_acceptance_estimate, acceptance_estimate, results=results)
    wrong = lambda acc, prop: sum(acc) / sum(prop)  # noqa: E731 - accepted / drafted
    assert any(r.acceptance_rate != r.acceptance_per_draft for r in results)
    assert_fails(checks.check_acceptance_estimate, wrong, results=results, match="accepted / drafted")


def test_refined_speedup_is_checked_on_the_learners_own_timings():
    own = [(0.77, 3, {1: 2.0, 2: 2.5, 3: 3.5, 4: 4.0}, 0.25)]
    off = lambda a, k, verify, draft: refined_speedup(a, k, verify, draft) * (1.01 if verify[1] == 2.0 else 1)  # noqa: E731
    assert_fails(checks.check_refined_speedup, off, own=own, match=r"refined_speedup\(a=0.77, k=3")


# -- likely slips, each named ----------------------------------------------------------------------------------------
def test_accept_greedy_slips():
    def count_all(logits, drafts):
        best = logits.argmax(-1).tolist()
        n = sum(d == b for d, b in zip(drafts, best, strict=False))
        return n, best[min(n, len(drafts))]

    assert_fails(checks.check_accept_greedy, count_all, match="stop at the first one that differs")

    def previous_row(logits, drafts):
        n, _ = accept_greedy(logits, drafts)
        return n, logits[max(n - 1, 0)].argmax().item()

    assert_fails(checks.check_accept_greedy, previous_row, match="row n_accepted - 1")

    def keeps_rejected(logits, drafts):
        n, nxt = accept_greedy(logits, drafts)
        return n, drafts[n] if n < len(drafts) else nxt

    assert_fails(checks.check_accept_greedy, keeps_rejected, match="rejected draft itself")

    def tensors(logits, drafts):
        n, _ = accept_greedy(logits, drafts)
        return n, logits[n].argmax()

    assert_fails(checks.check_accept_greedy, tensors, match="Python int")

    def last_max(logits, drafts):  # takes the last of tied maxima
        best = [row.numel() - 1 - row.flip(0).argmax().item() for row in logits]
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        return n, best[n]

    assert_fails(checks.check_accept_greedy, last_max, match="n_accepted")

    def equal_logit(logits, drafts):  # keeps a draft whose logit ties the maximum, whatever argmax picks
        n = 0
        while n < len(drafts) and logits[n, drafts[n]] == logits[n].max():
            n += 1
        return n, int(logits[n].argmax())

    assert_fails(checks.check_accept_greedy, equal_logit, match="has a tie: draft")

    def todo(logits, drafts):
        raise NotImplementedError

    assert_fails(checks.check_accept_greedy, todo, match="not implemented yet")


def test_expected_tokens_slips():
    assert_fails(checks.check_expected_tokens, lambda a, k: expected_tokens(a, k) - 1, match="target's own token")
    assert_fails(checks.check_expected_tokens, lambda a, k: 1 + k * a, match="a\\^i, not a")
    assert_fails(checks.check_expected_tokens, lambda a, k: expected_tokens(a, k - 1) if k else 1.0, match="a\\^k")
    assert_fails(checks.check_expected_tokens, lambda a, k: (1 - a ** (k + 1)) / (1 - a), match="0 / 0")


def test_acceptance_estimate_slips():
    rate = lambda acc, prop: sum(acc) / sum(prop)  # noqa: E731
    assert_fails(checks.check_acceptance_estimate, rate, match="accepted / drafted")

    def short_of_k(acc, prop):
        k = max(prop)
        return sum(acc) / (sum(acc) + sum(a < k for a in acc))

    assert_fails(checks.check_acceptance_estimate, short_of_k, match="what the step was offered")


def test_byte_speedup_slips():
    def draft_once(t, d, k, a):
        per = (t + d) / expected_tokens(a, k)
        return per, t / per

    assert_fails(checks.check_byte_speedup, draft_once, match="once per round")

    def no_draft(t, d, k, a):
        per = t / expected_tokens(a, k)
        return per, t / per

    assert_fails(checks.check_byte_speedup, no_draft, match="leaves out the draft")

    def all_kept(t, d, k, a):
        per = (t + k * d) / (k + 1)
        return per, t / per

    assert_fails(checks.check_byte_speedup, all_kept, match="k \\+ 1")

    def inverted(t, d, k, a):
        per, s = byte_speedup(t, d, k, a)
        return per, 1 / s

    assert_fails(checks.check_byte_speedup, inverted, match="inverted")


def test_refined_speedup_slips():
    byte_model = lambda a, k, v, d: expected_tokens(a, k) * v[1] / (v[1] + k * d)  # noqa: E731
    assert_fails(checks.check_refined_speedup, byte_model, match=r"T\(1\): use T\(k \+ 1\)")
    no_draft = lambda a, k, v, d: expected_tokens(a, k) * v[1] / v[k + 1]  # noqa: E731
    assert_fails(checks.check_refined_speedup, no_draft, match="k draft steps' time")
    t_k = lambda a, k, v, d: expected_tokens(a, k) * v[1] / (v[k] + k * d)  # noqa: E731
    assert_fails(checks.check_refined_speedup, t_k, match=r"T\(k\)")


def test_spec_roofline_slips():
    def batch_flops(target, draft, gpu, batch, context, k, a):
        return spec_roofline(target, draft, gpu, batch, context, k, a, verify_positions=batch)

    assert_fails(checks.check_spec_roofline, batch_flops, match="batch x \\(k \\+ 1\\) positions")

    def per_round(target, draft, gpu, batch, context, k, a):
        return spec_roofline(target, draft, gpu, batch, context, k, a, per_round=True)

    assert_fails(checks.check_spec_roofline, per_round, match="time per round")
    assert_fails(checks.check_spec_roofline, lambda *args: 1.0, match="a tuple of two numbers")

    def weights_of_one(target, draft, gpu, batch, context, k, a):
        n_bytes = roofline.weight_bytes_read(target) + roofline.kv_bytes_per_step(target, context, batch)
        flops = roofline.decode_flops(target, context, batch)
        return roofline.roofline_time_ms(flops, n_bytes, gpu.bf16_tflops * 1e12, gpu.bandwidth_gbps), 0.0

    batch_64 = [("llama-3.1-70b", "llama-3.1-8b", "h100-sxm", 64, 4096, 4, 0.8)]  # batch 1 reads as batch 1 does
    assert_fails(
        checks.check_spec_roofline, weights_of_one, cases=batch_64, match="pass batch=batch to weight_bytes_read"
    )


# -- hidden checks never show the expected value ---------------------------------------------------------------------
def test_hidden_checks_withhold_the_expected_value():
    msg = assert_fails(hidden.check_expected_tokens, lambda a, k: expected_tokens(a, k) - 1, match="hidden check")
    assert "target's own token" not in msg
    msg = assert_fails(hidden.check_byte_speedup, lambda t, d, k, a: (t / 3, 3.0), match="hidden check")
    case = lesson10.predict_speculative(123_456_789, 7, 0.55, 1.0, 9_876_543)
    assert repr(case.bytes_per_token) not in msg
    msg = assert_fails(hidden.check_accept_greedy, lambda logits, drafts: (0, 0), match="hidden check")
    assert "expected 0" not in msg and "expected 1" not in msg


def test_roofline_case_fades_with_batch():
    """The lesson's claim, on its own pair: speculation wins at batch 1 and loses at a large batch."""
    t70, d8, h100 = get_model("llama-3.1-70b"), get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    plain, spec = lesson10._roofline_steps(t70, d8, h100, 1, 1024, 4)[0], spec_roofline(t70, d8, h100, 1, 1024, 4, 0.9)
    assert spec[1] < plain
    plain, spec = spec_roofline(t70, d8, h100, 1024, 1024, 15, 0.9)
    assert spec > plain
