"""benchmarks/weight_term.py: its eager floor is the model's decode step with the abstractions taken out, so it
must compute the model's logits, for every attention layout it claims to cover, and decline the rest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvlab import Decoder
from kvlab.spec.config import MLAConfig

from .helpers import tiny_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "weight_term.py"


@pytest.fixture(scope="module")
def weight_term():
    spec = importlib.util.spec_from_file_location("weight_term", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_kv_heads": 4}, {"n_kv_heads": 1}, {"tie_embeddings": True}],
    ids=["gqa", "mha", "mqa", "tied-head"],
)
def test_eager_floor_computes_the_models_logits(weight_term, overrides) -> None:
    model = Decoder(tiny_config(**overrides), device="cpu", seed=3)
    with torch.inference_mode():
        assert weight_term.check_floor(model, [5, 17, 3, 99, 42, 0, 7]) < 1e-4


def test_eager_floor_notices_a_different_step(weight_term) -> None:
    model = Decoder(tiny_config(), device="cpu", seed=3)
    floor = weight_term.eager_floor(model, 4)
    mlp = model.layers[1].mlp
    mlp.w_down = torch.nn.Parameter(mlp.w_down.detach() * 1.5)  # a new tensor: the floor keeps the one it fetched
    with torch.inference_mode(), pytest.raises(AssertionError):
        weight_term.check_floor(model, [5, 17, 3], floor=floor)


def test_eager_floor_declines_models_it_does_not_cover(weight_term) -> None:
    windowed = tiny_config(layer_windows=(8, None))
    mla = tiny_config(mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16))
    assert weight_term.eager_floor(Decoder(windowed, device="cpu"), 4) is None
    assert weight_term.eager_floor(Decoder(mla, device="cpu"), 4) is None
    assert weight_term.eager_floor(Decoder(tiny_config(), device="cpu", weight_dtype="int8"), 4) is None
