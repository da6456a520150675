"""kvlab against transformers' own Llama, on random weights (no checkpoint, no network)."""

import os

import pytest
import torch
from torch.testing import assert_close

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from kvlab import Decoder, ModelConfig, from_hf, save_hf, to_hf  # noqa: E402
from kvlab.spec.dtypes import to_torch  # noqa: E402

from .helpers import assert_greedy_picks  # noqa: E402

# Two implementations of the same model: transformers projects Q, K, V and gate, up separately where kvlab fuses
# them, and computes RoPE and attention its own way, so every matmul sums in another order. Over 3 layers and 70
# positions that leaves under 1e-6 on logits below 2.
HF_TOL = dict(rtol=0, atol=1e-4)
# In bf16 (cuda, cpu-bf16) both sides round every activation to 8 bits, each at other points of its computation:
# logits up to 1.3 part by a few bf16 ulps (2^-8 near 1); 0.008 seen on CPU, 0.05 allows several. A wrong weight
# mapping or RoPE convention moves logits by O(1).
BF16_HF_TOL = dict(rtol=0, atol=0.05)


def _random_llama(**shape):
    base = dict(num_hidden_layers=3, max_position_embeddings=256, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(base | shape))).eval()
    # transformers initialises norms to 1; random norms make a wrong norm mapping visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


SHAPES = {
    "MHA odd sizes": dict(
        hidden_size=72, intermediate_size=100, num_attention_heads=6, num_key_value_heads=6, vocab_size=97
    ),
    "GQA odd sizes": dict(
        hidden_size=120,
        intermediate_size=212,
        num_attention_heads=10,
        num_key_value_heads=5,
        vocab_size=131,
        rope_theta=500000.0,
    ),
    "MQA tied head_dim": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        vocab_size=50,
        tie_word_embeddings=True,
    ),
    "llama3 rope": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_logits_and_greedy_tokens_match_transformers(shape, target):
    tol = target.tol(HF_TOL, BF16_HF_TOL)
    hf = _random_llama(**shape).to(device=target.device, dtype=to_torch(target.dtype))
    model = from_hf(hf, device=target.device, dtype=target.dtype)
    tokens = torch.randint(0, shape["vocab_size"], (2, 70), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(target.device)
    with torch.no_grad():
        assert_close(model(tokens).float(), hf(tokens).logits.float(), **tol)
        prompt = tokens[:, :10]
        theirs = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=20,
            do_sample=False,
            min_new_tokens=20,
            pad_token_id=0,
        )[:, 10:]
        ours = model.generate(prompt, max_new_tokens=20)
        # Each side's greedy tokens are the other's greedy picks, token by token; ties within HF_TOL may go
        # either way on a given CPU (and then the two continuations part).
        assert_greedy_picks(ours, hf(torch.cat([prompt, ours], dim=1)).logits[:, 9:-1].float(), **tol)
        assert_greedy_picks(theirs, model(torch.cat([prompt, theirs], dim=1))[:, 9:-1].float(), **tol)


def test_local_checkpoint_folder_round_trips(tmp_path):
    hf = _random_llama(**SHAPES["GQA odd sizes"])
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = from_hf(tmp_path / "hf", device="cpu")
    tokens = torch.randint(0, 131, (1, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
        assert_close(model(tokens), expected, **HF_TOL)
        save_hf(model, tmp_path / "kv")
        # The saved tensors reload into the same contiguous parameters: the same forward on the same bytes.
        assert_close(from_hf(tmp_path / "kv", device="cpu")(tokens), model(tokens), rtol=0, atol=0)
        assert_close(to_hf(model)(tokens).logits, expected, **HF_TOL)


def test_config_from_a_transformers_model_equals_the_config_json(tmp_path):
    hf = _random_llama(**SHAPES["MQA tied head_dim"])
    hf.config.save_pretrained(tmp_path)
    assert ModelConfig.from_hf_config(tmp_path) == ModelConfig.from_hf_config(hf.config)
    assert from_hf(hf).cfg.head_dim == 24


def test_missing_files_and_tensors_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16}'
    )
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        from_hf(tmp_path)
    with pytest.raises(ValueError, match="transformers model"):
        from_hf(42)


def test_unsupported_rope_scaling_is_refused_not_silently_ignored():
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        Decoder(cfg)
