"""Training: data, schedule, determinism, and the shipped checkpoint reproducing its recorded numbers."""

from __future__ import annotations

import dataclasses
import re
from importlib import resources

import pytest
import torch
from torch.testing import assert_close

from kvlab.pretrained import heldout_tokens, list_pretrained, load_pretrained, pretrained_info
from kvlab.quality import NEEDLE_LEN, perplexity
from kvlab.tokenizer import EOT, EOT_TEXT, VOCAB_SIZE, decode, encode
from kvlab.train import HELDOUT_FILES, TrainConfig, lr_at, sample_batch, train, training_corpus, training_files

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
    max_needles=1,
    threads=1,
)
SHIPPED = "kvlab-tiny-stdlib"


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return training_corpus()


def test_tokenizer_round_trips_text_and_the_special_token() -> None:
    text = f"def f(x):\n    return 'é'{EOT_TEXT}import os\n"
    ids = encode(text)
    assert ids.count(EOT) == 1 and max(ids) < VOCAB_SIZE
    assert len(ids) == len(text.encode()) - len(EOT_TEXT) + 1
    assert decode(ids) == text
    with pytest.raises(ValueError, match="^ids:"):
        decode([VOCAB_SIZE])


def test_heldout_files_never_enter_training(corpus: torch.Tensor) -> None:
    names = {p.name for p in training_files()}
    assert names.isdisjoint(HELDOUT_FILES) and len(names) > 50
    assert len(corpus) == sum(p.stat().st_size for p in training_files()) + len(names)


def test_needle_rows_repeat_each_planted_line(corpus: torch.Tensor) -> None:
    cfg = TrainConfig(seq_len=256, batch_size=16, needle_fraction=1.0, max_needles=3)
    batch = sample_batch(corpus, cfg, torch.Generator().manual_seed(1))
    assert batch.shape == (16, 257) and batch.dtype == torch.long
    for row in batch:
        lines = re.findall(r"\n# key \d{4} = \d{4}\n", decode(row))
        assert 2 <= len(lines) <= 6
        assert all(lines.count(line) == 2 for line in lines)


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
    assert_close(a, b, rtol=0, atol=0)
    other = torch.tensor(train(dataclasses.replace(cfg, seed=1), corpus, log=None).losses)
    assert not torch.equal(a, other)


def test_train_config_rejects_impossible_mixes() -> None:
    with pytest.raises(ValueError, match="^max_needles:"):
        TrainConfig(seq_len=2 * NEEDLE_LEN, max_needles=1)
    with pytest.raises(ValueError, match="^needle_fraction:"):
        TrainConfig(needle_fraction=1.5)


def test_shipped_checkpoint_reproduces_its_recorded_perplexity() -> None:
    assert SHIPPED in list_pretrained()
    record = pretrained_info(SHIPPED)["eval"]
    model = load_pretrained(SHIPPED, device="cpu")
    start, stop = record["slice"]
    assert stop - start <= 4096
    tokens = heldout_tokens()[start:stop]
    got = perplexity(model, tokens, context=record["context"], prefill_tokens=record["prefill_tokens"], progress=False)
    assert_close(got.ppl, record["perplexity"], rtol=0.01, atol=0)


def test_shipped_checkpoint_is_small_and_learned_something() -> None:
    info = pretrained_info(SHIPPED)
    assert info["model"]["vocab_size"] == VOCAB_SIZE
    assert len(resources.files("kvlab.data").joinpath(f"{SHIPPED}.safetensors").read_bytes()) <= 10_000_000
    # A byte model that learned nothing scores ln(257) nats; the recorded slice must be far below that.
    assert info["eval"]["perplexity"] < 8


def test_unknown_checkpoint_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=f"^name: .*{SHIPPED}"):
        load_pretrained("no-such-model")
