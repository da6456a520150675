import json

import pytest

from kvlab import ModelConfig, get_model, model_presets
from kvlab.presets import get_gpu

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


def test_windowed_presets_count_local_and_global_layers():
    gemma3 = get_model("gemma-3-27b")
    assert sum(w is None for w in gemma3.layer_windows) == 10
    assert sum(w == 1024 for w in gemma3.layer_windows) == 52
    assert sum(w is None for w in get_model("gpt-oss-20b").layer_windows) == 12


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


def _reference_path():
    from importlib import resources

    return resources.files("kvlab.data").joinpath("reference_presets.json")
