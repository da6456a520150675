import json
import subprocess
import sys

import pytest

from kvlab import ModelConfig, get_model, model_presets
from kvlab.spec.config import MoEConfig
from kvlab.spec.dtypes import canonical_dtype, to_torch
from kvlab.spec.presets import get_gpu

from .helpers import tiny_config


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads", "divisor of n_heads (1, 2, 4)"),
        ({"n_layers": 0}, "n_layers", "an integer >= 1"),
        ({"d_model": -8}, "d_model", "an integer >= 1"),
        ({"d_ff": 0}, "d_ff", "an integer >= 1"),
        ({"vocab_size": 2.5}, "vocab_size", "an integer >= 1"),
        ({"dtype": "float64"}, "dtype", "fp32, fp16, bf16"),
        ({"rope_theta": 0.0}, "rope_theta", "> 0"),
        ({"norm_eps": float("nan")}, "norm_eps", "> 0"),
        ({"d_model": 66, "n_heads": 4}, "head_dim", "give head_dim"),
        ({"head_dim": 15}, "head_dim", "even"),
        ({"layer_windows": (4,)}, "layer_windows", "n_layers=2"),
        ({"tie_embeddings": "yes"}, "tie_embeddings", "True or False"),
        ({"moe": MoEConfig(4, 2, 8, n_dense_layers=2)}, "moe.n_dense_layers", "fewer than n_layers=2"),
        ({"weight_dtypes": (("head", "bf16"),)}, "weight_dtypes", "embeddings, experts, other"),
        ({"weight_dtypes": (("experts", "fp5"),)}, "weight_dtypes['experts']", "mxfp4"),
    ],
)
def test_invalid_values_name_the_field_and_what_is_allowed(overrides, field, allowed):
    with pytest.raises(ValueError) as err:
        tiny_config(**overrides)
    assert str(err.value).startswith(field), err.value
    assert allowed in str(err.value)


def test_defaults_derive_head_dim_kv_heads_and_mlp_width():
    cfg = ModelConfig(n_layers=1, d_model=512, n_heads=8)
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.attention_kind) == (64, 8, "MHA")
    assert cfg.d_ff == 1408  # 8/3 * 512 = 1365.3, rounded up to a multiple of 64
    assert ModelConfig(n_layers=1, d_model=512, n_heads=8, n_kv_heads=1).attention_kind == "MQA"
    assert ModelConfig(n_layers=1, d_model=512, n_heads=8, n_kv_heads=2).attention_kind == "GQA-2"


def test_dtype_aliases_are_canonicalised():
    assert tiny_config(dtype="bfloat16").dtype == "bf16"
    assert tiny_config(dtype="float32").dtype == "fp32"


def test_torch_dtypes_are_read_by_name_and_made_on_demand():
    import torch

    for name, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert canonical_dtype(torch_dtype) == name
        assert to_torch(name) is torch_dtype
    assert tiny_config(dtype=torch.bfloat16).dtype == "bf16"
    assert canonical_dtype(torch.float8_e4m3fn) == "fp8"
    with pytest.raises(ValueError, match="^dtype: unknown dtype torch.float64; allowed: fp32, fp16, bf16"):
        to_torch(torch.float64)
    with pytest.raises(ValueError, match="^dtype: unknown dtype 'int8'; allowed: fp32, fp16, bf16"):
        to_torch("int8")


def test_course_presets_have_the_documented_shapes():
    tiny, small = get_model("cpu-tiny"), get_model("cpu-small")
    assert (tiny.n_layers, tiny.d_model, tiny.n_heads, tiny.head_dim) == (4, 256, 4, 64)
    assert (small.n_layers, small.d_model, small.n_heads, small.head_dim) == (8, 512, 8, 64)


def test_every_reference_model_is_a_preset_and_unrunnable_ones_say_why():
    reference = json.loads(_reference_path().read_text())["models"]
    presets = model_presets()
    for name, m in reference.items():
        cfg = presets[name]
        assert cfg.n_layers == m["layers"] and cfg.d_model == m["hidden"] and cfg.vocab_size == m["vocab"]
        if m.get("moe"):
            assert not cfg.runnable and cfg.not_runnable_reason
        else:
            assert cfg.runnable, name
            if not m["mla"]:
                assert (cfg.n_kv_heads, cfg.head_dim) == (m["kv_heads"], m["head_dim"])


def test_windowed_presets_put_global_layers_where_the_models_do():
    """Gemma-3: every sixth layer is global (5, 11, ..., 59) and the last two (60, 61) are local; Gemma-2 and
    gpt-oss alternate, starting local; Mistral-7B-v0.1 is local everywhere."""
    gemma3 = get_model("gemma-3-27b")
    assert [i for i, w in enumerate(gemma3.layer_windows) if w is None] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert gemma3.layer_windows[60:] == (1024, 1024)
    assert sum(w == 1024 for w in gemma3.layer_windows) == 52
    assert get_model("gemma-2-9b").layer_windows == (4096, None) * 21
    assert get_model("gpt-oss-20b").layer_windows == (128, None) * 12
    assert get_model("mistral-7b-v0.1").layer_windows == (4096,) * 32


def test_moe_config_validates_its_fields():
    with pytest.raises(ValueError, match="moe.top_k: 9; allowed: at most n_experts=8"):
        MoEConfig(8, 9, 64)
    with pytest.raises(ValueError, match="moe.n_shared_experts"):
        MoEConfig(8, 2, 64, n_shared_experts=-1)
    assert not tiny_config(moe=MoEConfig(8, 2, 64)).runnable


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match="model: unknown preset 'llama-9'; allowed: cpu-tiny, cpu-small"):
        get_model("llama-9")
    with pytest.raises(ValueError, match="allowed: .*h100-sxm"):
        get_gpu("h100")


def test_hf_config_json_gives_the_same_config(tmp_path):
    cfg = get_model("llama-3.1-8b")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    assert ModelConfig.from_hf_config(tmp_path) == cfg
    assert ModelConfig.from_hf_config(tmp_path / "config.json") == cfg


def test_hf_config_reads_the_keys_real_checkpoints_use():
    qwen_like = {
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "sliding_window": 131072,
        "use_sliding_window": False,
    }
    cfg = ModelConfig.from_hf_config(qwen_like)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.dtype, cfg.layer_windows) == (4, 128, "bf16", None)
    gemma_like = qwen_like | {"sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"] * 14}
    assert ModelConfig.from_hf_config(gemma_like).layer_windows == (4096, None) * 14
    v5 = qwen_like | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    del v5["rope_theta"]
    assert ModelConfig.from_hf_config(v5).rope_theta == 5e5
    with pytest.raises(ValueError, match="missing num_hidden_layers"):
        ModelConfig.from_hf_config({"hidden_size": 8})


def test_hf_config_reads_mixture_of_experts_keys_and_shipped_dtypes():
    deepseek_like = {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    cfg = ModelConfig.from_hf_config(deepseek_like)
    assert cfg.moe == MoEConfig(256, 8, 2048, n_shared_experts=1, n_dense_layers=3)
    assert (cfg.d_ff, dict(cfg.weight_dtypes)) == (18432, {"experts": "fp8", "other": "fp8"})
    gpt_oss_like = {
        "num_hidden_layers": 24,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "experts_per_token": 4,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    cfg = ModelConfig.from_hf_config(gpt_oss_like)
    assert (cfg.moe, cfg.weight_dtypes) == (MoEConfig(32, 4, 2880), (("experts", "mxfp4"),))
    assert ModelConfig.from_hf_config({k: v for k, v in gpt_oss_like.items() if "experts" not in k}).moe is None


def _reference_path():
    from importlib import resources

    return resources.files("kvlab.data").joinpath("reference_presets.json")


@pytest.mark.slow
def test_the_package_loads_its_public_names_on_first_use():
    code = (
        "import sys, kvlab; assert 'torch' not in sys.modules; "
        "from kvlab import ModelConfig, get_model; assert 'torch' not in sys.modules; "
        "from kvlab import Decoder; assert 'torch' in sys.modules and Decoder.__module__ == 'kvlab.model.decoder'; "
        "assert all(getattr(kvlab, name) is not None for name in kvlab.__all__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import kvlab

    with pytest.raises(AttributeError, match="no attribute 'Decodr'"):
        _ = kvlab.Decodr
