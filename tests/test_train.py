"""Training: data, schedule, determinism, and the shipped checkpoint reproducing its recorded numbers."""

from __future__ import annotations

import dataclasses
from functools import partial
from importlib import resources

import pytest
import torch
from torch.testing import assert_close

from kvlab.cache.policy.window import WindowKVCache
from kvlab.measure.quality import CHANCE, needle_recall, perplexity
from kvlab.measure.train import (
    HELDOUT_FILES,
    TrainConfig,
    card,
    lr_at,
    parser,
    sample_batch,
    split_targets,
    train,
    training_corpus,
    training_files,
)
from kvlab.model.pretrained import bos_token, heldout_tokens, list_pretrained, load_pretrained, pretrained_info
from kvlab.model.tokenizer import ASK, EOT, EOT_TEXT, N_PASSKEYS, VOCAB_SIZE, decode, encode, is_passkey, passkey

TINY = TrainConfig(
    n_layers=1,
    d_model=32,
    n_heads=2,
    n_kv_heads=1,
    d_ff=64,
    seq_len=96,
    batch_size=4,
    steps=40,
    lr=3e-3,
    warmup_steps=5,
    max_asks=1,
    threads=1,
)
SHIPPED = "kvlab-tiny-stdlib"
CHECKPOINTS = list_pretrained()


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return training_corpus()


def test_tokenizer_round_trips_text_and_the_special_tokens() -> None:
    text = f"def f(x):\n    return 'é'{EOT_TEXT}import os<|passkey:7|> x <|ask|><|passkey:{N_PASSKEYS - 1}|>\n"
    ids = encode(text)
    assert ids.count(EOT) == 1 and ids.count(ASK) == 1 and max(ids) < VOCAB_SIZE
    assert [i for i in ids if i > 255 and i not in (EOT, ASK)] == [passkey(7), passkey(N_PASSKEYS - 1)]
    assert decode(ids) == text
    # Look-alikes stay text: an out-of-range passkey and an unknown name.
    literal = f"<|passkey:{N_PASSKEYS}|><|nope|>"
    assert encode(literal) == list(literal.encode()) and decode(encode(literal)) == literal
    with pytest.raises(ValueError, match="^ids:"):
        decode([VOCAB_SIZE])
    with pytest.raises(ValueError, match="^passkey:"):
        passkey(N_PASSKEYS)


def test_heldout_files_never_enter_training(corpus: torch.Tensor) -> None:
    names = {p.name for p in training_files()}
    assert names.isdisjoint(HELDOUT_FILES) and len(names) > 50
    assert len(corpus) == sum(p.stat().st_size for p in training_files()) + len(names)


def test_needle_rows_plant_one_passkey_and_ask_for_it_later(corpus: torch.Tensor) -> None:
    cfg = TrainConfig(seq_len=256, batch_size=32, needle_fraction=1.0, max_asks=3)
    batch = sample_batch(corpus, cfg, torch.Generator().manual_seed(1))
    assert batch.shape == (32, 257) and batch.dtype == torch.long
    gaps = []
    for row in batch:
        asks = (row == ASK).nonzero().flatten()
        keys = is_passkey(row).nonzero().flatten()
        assert 1 <= len(asks) <= 3 and len(keys) == len(asks) + 1
        assert len(set(row[keys].tolist())) == 1, "one passkey per row"
        assert torch.equal(keys[1:], asks + 1), "every ask is followed by the passkey"
        assert keys[0] < asks[0], "the passkey is planted before the first question"
        gaps += (asks - keys[0]).tolist()
    # Log-uniform distances: both short and long gaps occur.
    assert min(gaps) < 16 and max(gaps) > 64


def test_bos_rows_are_the_plain_rows_shifted_behind_endoftext(corpus: torch.Tensor) -> None:
    plain = sample_batch(corpus, TINY, torch.Generator().manual_seed(3))
    with_bos = sample_batch(corpus, dataclasses.replace(TINY, bos=True), torch.Generator().manual_seed(3))
    assert with_bos.shape == plain.shape
    assert bool((with_bos[:, 0] == EOT).all()) and torch.equal(with_bos[:, 1:], plain[:, :-1])


def test_boolean_flags_parse_both_ways() -> None:
    assert parser().parse_args(["--bos"]).bos is True
    assert parser().parse_args(["--no-bos"]).bos is False and parser().parse_args([]).bos is False


def test_split_targets_scores_text_and_answers_apart() -> None:
    pk = passkey(5)
    batch = torch.tensor([[10, 11, pk, 12, 13, ASK, pk, 14, 15]])
    inputs, text, answers = split_targets(batch)
    assert torch.equal(inputs, batch[:, :-1])
    # Ignored: the planted passkey, the question, and the answer (it is scored on its own).
    assert text.tolist() == [[11, -100, 12, 13, -100, -100, 14, 15]]
    assert answers.tolist() == [[False, False, False, False, False, True, False, False]]
    assert batch[:, 1:][answers].tolist() == [pk]


def test_lr_warms_up_then_decays_to_the_floor() -> None:
    cfg = TrainConfig(steps=200, warmup_steps=20, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(5e-5)
    assert lr_at(19, cfg) == pytest.approx(1e-3)
    assert lr_at(199, cfg) == pytest.approx(1e-4, rel=1e-3)


def test_short_run_lowers_the_loss(corpus: torch.Tensor) -> None:
    losses = train(TINY, corpus, log=None).losses
    assert len(losses) == TINY.steps
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, f"loss went from {first:.3f} to {last:.3f}; expected a drop of more than 1 nat"


def test_same_seed_gives_the_same_losses(corpus: torch.Tensor) -> None:
    cfg = dataclasses.replace(TINY, steps=8)
    a, b = (torch.tensor(train(cfg, corpus, log=None).losses) for _ in range(2))
    # The same function, seed and thread count (threads=1) twice: the same kernels in the same order, bit for bit.
    assert_close(a, b, rtol=0, atol=0)
    other = torch.tensor(train(dataclasses.replace(cfg, seed=1), corpus, log=None).losses)
    assert not torch.equal(a, other)


def test_train_config_rejects_impossible_mixes() -> None:
    with pytest.raises(ValueError, match="^max_asks:"):
        TrainConfig(seq_len=16, max_asks=4)
    with pytest.raises(ValueError, match="^max_asks:"):
        TrainConfig(max_asks=0)
    with pytest.raises(ValueError, match="^needle_weight:"):
        TrainConfig(needle_weight=-1.0)
    with pytest.raises(ValueError, match="^needle_fraction:"):
        TrainConfig(needle_fraction=1.5)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.slow
def test_shipped_checkpoint_reproduces_its_recorded_perplexity(name: str) -> None:
    assert name in list_pretrained()
    record = pretrained_info(name)["eval"]
    model = load_pretrained(name, device="cpu")
    start, stop = record["slice"]
    assert stop - start <= 4096
    tokens = heldout_tokens()[start:stop]
    got = perplexity(
        model, tokens, record["context"], prefill_tokens=record["prefill_tokens"], progress=False, bos=bos_token(name)
    )
    # Recorded when the checkpoint was trained, on whatever CPU that was; rounding moves a perplexity by ~1e-6 of
    # itself, a different slice or context by percents.
    assert_close(got.ppl, record["perplexity"], rtol=0.01, atol=0)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.slow
def test_shipped_checkpoint_reproduces_its_recorded_recall(name: str) -> None:
    record = pretrained_info(name)["eval"]
    cell = record["needle"][len(record["needle"]) // 2]
    model = load_pretrained(name, device="cpu")
    (got,) = needle_recall(
        model, [cell["context"]], [cell["depth"]], record["needle_trials"], progress=False, bos=bos_token(name)
    )
    assert got.distance == cell["distance"]
    # Greedy answers: a near-tie may flip a trial on another CPU; 0.05 allows two of the 40 recorded trials.
    assert_close(got.accuracy, cell["accuracy"], rtol=0, atol=0.05)
    assert_close(got.answer_prob, cell["answer_prob"], rtol=0, atol=0.02)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.slow
def test_shipped_checkpoint_reproduces_its_recorded_sink_study(name: str) -> None:
    """One row of the card's sink study: window + sinks, reassigned, past the trained length."""
    study = pretrained_info(name)["eval"]["sinks"]
    model = load_pretrained(name, device="cpu")
    bos = bos_token(name)
    text = heldout_tokens()[: study["segments"] * (study["context"] - (bos is not None))]
    make_cache = partial(WindowKVCache.for_model, window=study["window"], sinks=study["sinks"], positions="reassigned")
    got = perplexity(model, text, study["context"], make_cache, progress=False, bos=bos)
    assert got.n_segments == study["segments"]
    assert_close(got.ppl, study["perplexity"]["window+sinks/reassigned"], rtol=0.01, atol=0)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_shipped_checkpoint_is_small_and_learned_something(name: str) -> None:
    info = pretrained_info(name)
    assert info["model"]["vocab_size"] == VOCAB_SIZE
    assert len(resources.files("kvlab.data").joinpath(f"{name}.safetensors").read_bytes()) <= 10_000_000
    # A byte model that learned nothing scores ln(257) nats; the recorded slice must be far below that.
    assert info["eval"]["perplexity"] < 8
    # Passkey recall well above chance at every recorded depth.
    assert all(n["accuracy"] > 10 * CHANCE for n in info["eval"]["needle"])


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_shipped_card_is_rendered_from_its_record(name: str) -> None:
    data = resources.files("kvlab.data")
    size = len(data.joinpath(f"{name}.safetensors").read_bytes())
    assert data.joinpath(f"{name}.md").read_text() == card(name, pretrained_info(name), size)


def test_bos_token_follows_the_training_record() -> None:
    assert bos_token("kvlab-tiny-stdlib") is None and bos_token("kvlab-tiny-stdlib-bos") == EOT


def test_unknown_checkpoint_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=f"^name: .*{SHIPPED}"):
        load_pretrained("no-such-model")
