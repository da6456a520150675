"""Sampling in the engine: temperature 0 is the greedy path unchanged; a sampled token is a draw from
softmax(logits / T) cut by top-k and top-p (chi-square over many seeds); a seed gives the same tokens whatever else
is batched or preempted; a stop token ends a request; logprobs are the model's own."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import Engine, Request
from kvlab.model.decoder import Decoder
from kvlab.model.sampling import SamplingParams

from .helpers import sharp_random_model, tiny_config
from .test_speculative import ALPHA, chi_square_p_value

CFG = tiny_config()


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(CFG)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]  # fmt: skip


def test_temperature_zero_is_the_plain_greedy_path(model: Decoder) -> None:
    ps = prompts(6)
    engine = Engine(model, n_blocks=64, block_size=4, max_batch=3, token_budget=10)
    plain = engine.run([Request(p, 7) for p in ps])
    zero = engine.run([Request(p, 7, sampling=SamplingParams(0, 3, 0.5, 11, logprobs=2)) for p in ps])
    assert [r.output_ids for r in zero.results] == [r.output_ids for r in plain.results]
    alone = Engine(model, n_blocks=64, block_size=4).run([Request(ps[0], 7)]).results[0].output_ids
    assert alone == model.generate(ps[0], 7).tolist()


@pytest.mark.slow
def test_sampled_first_tokens_follow_the_truncated_softmax() -> None:
    vocab, n_runs, temperature, top_k, top_p = 12, 800, 0.8, 6, 0.9
    m = sharp_random_model(vocab, seed=3)
    prompt = [1, 5, 2, 7, 3, 1, 5, 2, 7]  # two full blocks of 4: every request after the first prefills one token
    engine = Engine(m, n_blocks=8 * 64, block_size=4, max_batch=64, token_budget=64 * 4)
    sampling = [SamplingParams(temperature, top_k, top_p, seed) for seed in range(n_runs)]
    report = engine.run([Request(prompt, 1, sampling=s) for s in sampling])  # batched, each with its own seed
    counts = torch.bincount(torch.tensor([r.output_ids[0] for r in report.results]), minlength=vocab)

    with torch.no_grad():
        logits = m(torch.tensor([prompt]))[0, -1].double()
    plain = torch.softmax(logits / temperature, -1)
    order = plain.argsort(descending=True)
    kept = plain[order[:top_k]] / plain[order[:top_k]].sum()
    # top-p: the smallest set of the most likely tokens whose probability reaches top_p
    n_kept = int((torch.cumsum(kept, 0) - kept < top_p).sum())
    want = torch.zeros(vocab, dtype=torch.float64)
    want[order[:n_kept]] = kept[:n_kept] / kept[:n_kept].sum()
    assert 3 <= n_kept < top_k, "the test needs top-p to cut inside top-k, leaving several likely tokens"
    assert chi_square_p_value(counts, want) > ALPHA
    # power: neither the untruncated distribution nor top-k alone is what the engine drew from
    assert chi_square_p_value(counts, plain) < ALPHA
    top_k_only = torch.zeros(vocab, dtype=torch.float64)
    top_k_only[order[:top_k]] = kept
    assert chi_square_p_value(counts, top_k_only) < ALPHA


def test_a_seed_draws_the_same_tokens_alone_batched_and_preempted(model: Decoder) -> None:
    ps = prompts(6, seed=1)
    mine = Request(ps[0], 12, sampling=SamplingParams(1.0, seed=7))
    alone = Engine(model, n_blocks=64, block_size=4).run([mine]).results[0].output_ids
    others = [Request(p, 12, i * 0.001, SamplingParams(1.0, seed=100 + i)) for i, p in enumerate(ps[1:])]
    # 12 blocks of 4 cannot hold six requests of up to 23 tokens: the newest are preempted and recomputed.
    engine = Engine(model, n_blocks=12, block_size=4, max_batch=6, token_budget=8)
    report = engine.run([*others, mine])
    assert report.preemptions > 0
    assert report.results[-1].output_ids == alone
    reseeded = Request(ps[0], 12, sampling=SamplingParams(1.0, seed=8))
    assert Engine(model, n_blocks=64, block_size=4).run([reseeded]).results[0].output_ids != alone


def test_a_stop_token_ends_the_request_and_frees_its_blocks(model: Decoder) -> None:
    prompt = prompts(1, seed=2)[0]
    greedy = model.generate(prompt, 10).tolist()
    stop = greedy[4]
    engine = Engine(model, n_blocks=32, block_size=4)
    out = engine.run([Request(prompt, 10, sampling=SamplingParams(stop_token_ids=frozenset({stop})))])
    assert out.results[0].output_ids == greedy[: greedy.index(stop) + 1]
    assert engine.free_blocks == engine.n_blocks


def test_logprobs_are_the_models_own(model: Decoder) -> None:
    prompt = prompts(1, seed=3)[0]
    got = []
    engine = Engine(model, n_blocks=32, block_size=4)
    engine.start()
    engine.add(Request(prompt, 5, sampling=SamplingParams(1.0, seed=0, logprobs=3)), lambda t, lp: got.append(lp))
    while engine.busy:
        engine.step()
    tokens = [lp.token for lp in got]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].float(), -1)
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]), logp[range(5), tokens], rtol=1e-4, atol=1e-4)
    for lp, row in zip(got, logp, strict=True):
        top = row.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("kwargs", "field"), [({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"),
                                               ({"top_p": 1.5}, "top_p"), ({"logprobs": -1}, "logprobs")])  # fmt: skip
def test_bad_sampling_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
