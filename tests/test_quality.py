"""Quality measures against brute force: one full forward pass scores what the streamed cache should."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from kvlab.cache.base import default_cache
from kvlab.cache.codec.kivi import QuantizedKVCache
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.cache.policy.window import WindowKVCache
from kvlab.cache.storage.paged import PagedKVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.measure import quality
from kvlab.measure.quality import (
    attention_sink_share,
    needle_prompts,
    needle_recall,
    perplexity,
    uniform_first_token_share,
)
from kvlab.model.decoder import Decoder
from kvlab.model.pretrained import heldout_tokens, load_pretrained
from kvlab.model.tokenizer import ASK, EOT, VOCAB_SIZE, is_passkey
from kvlab.spec.config import ModelConfig

from .helpers import assert_greedy_picks, sharp_random_model

# Streamed (a prefill, then one decode step per token) vs one forward pass: the same sums in another order. Logits
# reach ~4 for the 10x random model and ~14 for the shipped one, and rounding leaves a few ulps of that.
STREAM_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return sharp_random_model(VOCAB_SIZE)


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    return heldout_tokens()[:200]


class ForgetfulCache(ContiguousKVCache):
    """Keeps only the newest step's tokens: every ``reserve`` first drops all it held."""

    def reserve(self, n_new: int) -> int:
        self.reset()
        return super().reserve(n_new)


def forgetful(model: Decoder, batch_size: int, capacity: int) -> ContiguousKVCache:
    return ForgetfulCache.for_model(model, batch_size, capacity)


def brute_force_nll(model: Decoder, tokens: torch.Tensor, context: int, prefill: int) -> torch.Tensor:
    """Mean NLL per scored position ``[context - prefill]`` from one full forward pass over each segment."""
    n = len(tokens) // context
    segments = tokens[: n * context].view(n, context).to(model.device)
    with torch.no_grad():
        logp = F.log_softmax(model(segments).float(), dim=-1)
    nll = -logp[:, :-1].gather(-1, segments[:, 1:, None]).squeeze(-1)  # [n, context - 1], predicting 1..C-1
    return nll[:, prefill - 1 :].double().mean(dim=0).cpu()


# NLLs (~1 to 10 nats) are log-softmaxes of logits that differ by STREAM_TOL, averaged over segments. In bf16 the
# 10x model's logits (up to ~4) carry 2^-9 of themselves per rounding, and the two paths round differently: 0.016 nats
# seen on CPU per position, 0.1 allows several; a position off by one changes an NLL by nats.
NLL_TOL = dict(rtol=1e-4, atol=1e-5)
BF16_NLL_TOL = dict(rtol=0, atol=0.1)


@pytest.mark.parametrize(("context", "prefill", "batch_size"), [(48, 1, 16), (48, 20, 2), (64, 63, 1)])
def test_streamed_perplexity_matches_one_forward_pass(
    target, text: torch.Tensor, context: int, prefill: int, batch_size: int
) -> None:
    model = sharp_random_model(VOCAB_SIZE, dtype=target.dtype).to(target.device)
    got = perplexity(model, text, context=context, prefill_tokens=prefill, batch_size=batch_size, progress=False)
    want = brute_force_nll(model, text, context, prefill)
    assert got.n_segments == len(text) // context
    assert got.n_scored == got.n_segments * (context - prefill)
    tol = target.tol(NLL_TOL, BF16_NLL_TOL)
    assert_close(torch.tensor(got.nll_by_position, dtype=torch.float64), want, **tol)
    assert_close(got.ppl, float(want.mean().exp()), rtol=1e-4 if target.dtype == "fp32" else 0.1, atol=0)


def test_the_cache_policy_acts_while_streaming(model: Decoder, text: torch.Tensor) -> None:
    full = perplexity(model, text, context=48, prefill_tokens=8, progress=False)
    forgot = perplexity(model, text, context=48, prefill_tokens=8, make_cache=forgetful, progress=False)
    # The first scored prediction comes from the prefill, which saw the whole chunk either way; the later ones
    # were decoded through a cache that had forgotten everything, so they must differ.
    assert_close(forgot.nll_by_position[0], full.nll_by_position[0], rtol=1e-4, atol=1e-5)
    assert abs(forgot.ppl - full.ppl) > 0.01 * full.ppl


def test_factory_gets_batch_and_capacity(model: Decoder, text: torch.Tensor) -> None:
    calls = []

    def spy(m: Decoder, batch_size: int, capacity: int) -> ContiguousKVCache:
        calls.append((batch_size, capacity))
        return default_cache(m, batch_size, capacity)

    perplexity(model, text, context=64, make_cache=spy, batch_size=2, progress=False)
    assert calls == [(2, 64), (1, 64)]


def test_needle_prompts_plant_the_passkey_at_the_depth() -> None:
    filler = heldout_tokens()[:1000]
    prompts, answers, pos = needle_prompts(context=200, depth=0.5, n_trials=3, filler=filler, seed=7)
    assert prompts.shape == (3, 200) and answers.shape == (3,)
    assert pos == round(0.5 * 198)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert prompt[-1] == ASK and prompt[pos] == answer and bool(is_passkey(answer))
        assert int(is_passkey(prompt).sum()) == 1, "the passkey appears once, before the question"
    first, _, _ = needle_prompts(context=200, depth=0.0, n_trials=1, filler=filler, seed=7)
    last, _, last_pos = needle_prompts(context=200, depth=1.0, n_trials=1, filler=filler, seed=7)
    assert bool(is_passkey(first[0, 0])) and last_pos == 198 and bool(is_passkey(last[0, -2]))
    again, _, _ = needle_prompts(context=200, depth=0.5, n_trials=3, filler=filler, seed=7)
    other, _, _ = needle_prompts(context=200, depth=0.5, n_trials=3, filler=filler, seed=8)
    assert torch.equal(prompts, again) and not torch.equal(prompts, other)


def test_bos_starts_every_segment_and_goes_unscored(model: Decoder, text: torch.Tensor) -> None:
    got = perplexity(model, text, context=48, progress=False, bos=EOT)
    # Each segment is BOS + 47 text tokens; brute force over the same rows, scoring every text token.
    rows = torch.cat((torch.full((len(text) // 47, 1), EOT), text[: len(text) // 47 * 47].view(-1, 47)), dim=1)
    want = brute_force_nll(model, rows.flatten(), 48, 1)
    assert got.n_segments == len(text) // 47 and got.n_scored == got.n_segments * 47
    assert_close(torch.tensor(got.nll_by_position, dtype=torch.float64), want, rtol=1e-4, atol=1e-5)


def test_needle_prompts_with_bos_keep_the_context_length() -> None:
    filler = heldout_tokens()[:1000]
    plain, answers, pos = needle_prompts(context=200, depth=0.5, n_trials=3, filler=filler, seed=7)
    with_bos, bos_answers, bos_pos = needle_prompts(200, 0.5, 3, filler, seed=7, bos=EOT)
    assert with_bos.shape == (3, 200) and bool((with_bos[:, 0] == EOT).all())
    assert torch.equal(answers, bos_answers) and bos_pos == 1 + round(0.5 * 197)
    assert bool((with_bos[:, bos_pos] == answers).all()) and bool((with_bos[:, -1] == ASK).all())
    assert pos == round(0.5 * 198)


def test_attention_sink_share_of_even_attention_is_the_harmonic_share(text: torch.Tensor) -> None:
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=VOCAB_SIZE, max_seq_len=64)
    m = Decoder(cfg, device="cpu", seed=0)
    with torch.no_grad():
        for layer in m.layers:
            layer.attn.wqkv[:, : cfg.n_heads * cfg.head_dim] = 0  # every score 0: each query spreads evenly
    shares = attention_sink_share(m, text, context=40, n_segments=3)
    assert_close(shares, [uniform_first_token_share(40)] * 2, rtol=1e-5, atol=0)
    late = attention_sink_share(m, text, context=40, n_segments=3, queries=10)  # a prefill, then 10 decode steps
    assert_close(late, [uniform_first_token_share(40, 10)] * 2, rtol=1e-5, atol=0)
    assert_close(uniform_first_token_share(3), (1 + 1 / 2 + 1 / 3) / 3, rtol=1e-12, atol=0)
    assert_close(uniform_first_token_share(3, 1), 1 / 3, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="^queries:"):
        attention_sink_share(m, text, context=40, n_segments=1, queries=41)
    with pytest.raises(ValueError, match="^n_segments:"):
        attention_sink_share(m, text, context=40, n_segments=6)
    with pytest.raises(ValueError, match="^bos:"):
        attention_sink_share(m, text, context=40, n_segments=1, bos=VOCAB_SIZE)


@pytest.mark.parametrize("which", ["random", "shipped"])
@pytest.mark.slow
def test_needle_recall_matches_one_full_forward_pass(model: Decoder, which: str) -> None:
    m = model if which == "random" else load_pretrained("kvlab-tiny-stdlib", device="cpu")
    filler = heldout_tokens()
    contexts, depths, n = [64, 96], [0.0, 1.0], 4
    results = needle_recall(
        m, contexts, depths, n_trials=n, seed=3, prefill_tokens=5, batch_size=3, filler=filler, progress=False
    )
    assert [(r.context, r.depth) for r in results] == [(c, d) for c in contexts for d in depths]
    for r in results:
        prompts, answers, pos = needle_prompts(r.context, r.depth, n, filler, seed=3)
        with torch.no_grad():
            logits = m(prompts)[:, -1].float()
        probs = torch.softmax(logits, dim=-1)
        # Streamed predictions are the forward pass's greedy picks, up to ties within the paths' rounding.
        assert_greedy_picks(torch.tensor(r.predictions), logits, **STREAM_TOL)
        assert list(r.answers) == answers.tolist()
        correct = sum(p == a for p, a in zip(r.predictions, r.answers, strict=True))  # counted from the ids: exact
        assert r.n_correct == correct and r.accuracy == r.n_correct / n
        assert_close(r.answer_prob, float(probs.gather(-1, answers[:, None]).mean()), rtol=1e-4, atol=1e-6)
        assert r.distance == r.context - 1 - pos


def test_needle_recall_counts_exact_matches(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the first two trials' passkeys equal to what the model will say, so two must count as correct."""
    kwargs = dict(contexts=[64], depths=[0.5], n_trials=5, filler=heldout_tokens(), progress=False)
    # What the model says, from the same streamed computation on the same prompts as the rigged run below, so the
    # same ids bit for bit (a forward pass could break a near-tie the other way).
    (honest,) = needle_recall(model, **kwargs)
    said = torch.tensor(honest.predictions[:2])

    def rigged(context: int, depth: float, n_trials: int, filler: torch.Tensor, seed: int = 0, bos: int | None = None):
        prompts, answers, pos = needle_prompts(context, depth, n_trials, filler, seed, bos)
        return prompts, torch.cat((said, answers[2:])), pos

    monkeypatch.setattr(quality, "needle_prompts", rigged)
    (r,) = needle_recall(model, **kwargs)
    assert r.n_correct == 2 + sum(p == a for p, a in zip(r.predictions[2:], r.answers[2:], strict=True))
    assert r.accuracy == r.n_correct / 5 and r.n_correct >= 2


@pytest.mark.slow
def test_needle_recall_falls_to_chance_when_the_cache_forgets() -> None:
    """The shipped model finds the passkey with its full cache and not with one that keeps only the newest token."""
    m = load_pretrained("kvlab-tiny-stdlib", device="cpu")
    kwargs = {"contexts": [128], "depths": [0.25], "n_trials": 16, "progress": False}
    (full,) = needle_recall(m, **kwargs)
    (forgot,) = needle_recall(m, make_cache=forgetful, **kwargs)
    assert full.accuracy >= 0.9, full
    assert forgot.accuracy <= 0.25 and forgot.answer_prob < full.answer_prob / 4, forgot


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tokens": torch.zeros(2, 100, dtype=torch.long)}, "tokens"),
        ({"tokens": torch.zeros(100)}, "tokens"),
        ({"tokens": list(range(10))}, "tokens"),
        ({"context": 1}, "context"),
        ({"prefill_tokens": 0}, "prefill_tokens"),
        ({"prefill_tokens": 32}, "prefill_tokens"),
        ({"batch_size": 0}, "batch_size"),
        ({"make_cache": "full"}, "make_cache"),
        ({"bos": True}, "bos"),
        ({"bos": -1}, "bos"),
    ],
)
def test_perplexity_rejects_bad_inputs(model: Decoder, text: torch.Tensor, kwargs: dict, name: str) -> None:
    args = {"tokens": text, "context": 32, "progress": False, **kwargs}
    with pytest.raises(ValueError, match=f"^{name}:"):
        perplexity(model, **args)


def test_needle_recall_names_a_model_without_passkeys() -> None:
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=257, max_seq_len=64)
    with pytest.raises(ValueError, match=f"^model: vocab_size 257 .*>= {VOCAB_SIZE}"):
        needle_recall(Decoder(cfg, device="cpu", seed=0), [32], [0.5], progress=False)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"contexts": []}, "contexts"),
        ({"contexts": [2]}, "contexts"),
        ({"contexts": [64.0]}, "contexts"),
        ({"depths": [1.5]}, "depths"),
        ({"depths": []}, "depths"),
        ({"n_trials": 0}, "n_trials"),
        ({"make_cache": None}, "make_cache"),
        ({"filler": torch.zeros(0, dtype=torch.long)}, "filler"),
    ],
)
def test_needle_recall_rejects_bad_inputs(model: Decoder, kwargs: dict, name: str) -> None:
    args = {"contexts": [64], "depths": [0.5], "n_trials": 2, "progress": False, **kwargs}
    with pytest.raises(ValueError, match=f"^{name}:"):
        needle_recall(model, **args)


# One pass against the stream, through caches that claim ``prefill_is_stepwise``. A codec's codes come from K/V
# computed by a matrix product in one pass and a matrix-vector product per step: a code can land one step apart,
# which moves a position's NLL by a few hundredths of a nat, and the mean by far less.
STEPWISE_CACHES = {
    "contiguous, int4": partial(ContiguousKVCache.for_model, codec="int4"),
    "window 12 + 2 sinks, int8": partial(WindowKVCache.for_model, window=12, sinks=2, codec="int8"),
    "paged, window 9 + 1 sink": partial(PagedKVCache.for_model, block_size=4, window=9, sinks=1),
}


@pytest.mark.parametrize("name", STEPWISE_CACHES)
def test_one_pass_measures_what_the_stream_does(model: Decoder, text: torch.Tensor, name: str) -> None:
    kw = dict(context=48, prefill_tokens=5, make_cache=STEPWISE_CACHES[name], batch_size=2, progress=False)
    streamed, one_pass = perplexity(model, text, **kw), perplexity(model, text, one_pass=True, **kw)
    assert (one_pass.n_scored, one_pass.prefill_tokens) == (streamed.n_scored, streamed.prefill_tokens)
    by_position = [torch.tensor(r.nll_by_position, dtype=torch.float64) for r in (one_pass, streamed)]
    assert_close(*by_position, rtol=0, atol=0.05)
    assert_close(one_pass.ppl, streamed.ppl, rtol=2e-3, atol=0)
    # The window must have acted in the one pass too: the full cache's perplexity differs.
    if "window" in name:
        full = perplexity(model, text, context=48, prefill_tokens=5, batch_size=2, progress=False, one_pass=True)
        assert abs(full.ppl - one_pass.ppl) > 0.01 * full.ppl


@pytest.mark.parametrize(
    "make_cache",
    [
        partial(HeavyHitterKVCache.for_model, heavy=4, recent=4),
        partial(QuantizedKVCache.for_model, codec="int8", group_size=4, residual=4),
    ],
    ids=["H2O", "KIVI with a residual"],
)
def test_one_pass_refuses_a_cache_whose_prefill_is_not_stepwise(model: Decoder, text: torch.Tensor, make_cache) -> None:
    with pytest.raises(ValueError, match="make_cache: its .*KVCache does not keep"):
        perplexity(model, text, context=48, make_cache=make_cache, progress=False, one_pass=True)
    with pytest.raises(ValueError, match="one_pass"):
        perplexity(model, text, context=48, progress=False, one_pass=1)
