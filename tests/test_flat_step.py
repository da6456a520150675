"""benchmarks/flat_step.py: the flat step (the eager floor, and the graph ONNX Runtime runs whole) is the model's
decode step with the abstractions taken out, so it must compute the model's logits, for every attention layout it
claims to cover, and decline the rest. kvlab's own ONNX Runtime step is tested in tests/test_onnx_step.py."""

from __future__ import annotations

import pytest
import torch

from kvlab import Decoder
from kvlab.spec.config import MLAConfig

from .helpers import benchmark_module, tiny_config


@pytest.fixture(scope="module")
def flat_step():
    return benchmark_module("flat_step")


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_kv_heads": 4}, {"n_kv_heads": 1}, {"tie_embeddings": True}],
    ids=["gqa", "mha", "mqa", "tied-head"],
)
def test_flat_step_computes_the_models_logits(flat_step, overrides) -> None:
    model = random_norms(Decoder(tiny_config(**overrides), device="cpu", seed=3))
    with torch.inference_mode():
        assert flat_step.check_step(model, [5, 17, 3, 99, 42, 0, 7]) < 1e-4


def random_norms(model: Decoder) -> Decoder:
    """``model`` with its norm weights drawn from U(0.5, 1.5): at their initial ones, a floor that skipped or
    swapped a norm's weight would still match."""
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model


@pytest.mark.parametrize("weight", ["layers.1.mlp.w_down", "layers.0.mlp_norm.weight"])
def test_flat_step_notices_a_different_weight(flat_step, weight) -> None:
    model = random_norms(Decoder(tiny_config(), device="cpu", seed=3))
    floor = flat_step.FlatStep(model)
    owner_name, attr = weight.rsplit(".", 1)
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, torch.nn.Parameter(getattr(owner, attr).detach() * 1.5))  # the floor keeps the old tensor
    with torch.inference_mode(), pytest.raises(AssertionError):
        flat_step.check_step(model, [5, 17, 3], floor)


def test_flat_step_declines_models_it_does_not_cover(flat_step) -> None:
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
    others = [
        Decoder(tiny_config(layer_windows=(8, None)), device="cpu"),
        Decoder(tiny_config(mla=mla), device="cpu"),
        Decoder(tiny_config(), device="cpu", weight_dtype="int8"),
        Decoder(tiny_config(dtype="bf16"), device="cpu"),
    ]
    assert flat_step.floor_covers(Decoder(tiny_config(), device="cpu"))
    for model in others:
        assert not flat_step.floor_covers(model)
        with pytest.raises(ValueError, match="allowed: a dense fp32 model"):
            flat_step.FlatStep(model)


@pytest.mark.parametrize(("factory", "runtime"), [("onnx_step", "onnxruntime"), ("openvino_step", "openvino")])
def test_a_runtime_runs_the_models_step(flat_step, factory, runtime) -> None:
    """The whole flat step on another runtime computes the model's logits in fp32: on a CPU with bf16 instructions,
    OpenVINO's default precision (bf16) would miss by far more than the tolerance."""
    pytest.importorskip(runtime)
    pytest.importorskip("onnx")
    model = random_norms(Decoder(tiny_config(tie_embeddings=True), device="cpu", seed=3))
    with torch.inference_mode():
        step = getattr(flat_step, factory)(flat_step.FlatStep(model), threads=1)
        assert flat_step.check_step(model, [5, 17, 3, 99, 42], step) < 1e-4
