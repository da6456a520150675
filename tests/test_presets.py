"""Presets against the models' own configs: context lengths, tied embeddings and shipped weight formats."""

import pytest

from kvlab import get_model
from kvlab.roofline import active_params, param_count, predict, weight_bytes
from kvlab.spec.presets import draft_of, get_gpu, gpu_presets, model_presets, same_vocabulary
from kvlab.spec.published import HARDWARE_CLASSES

# max_position_embeddings from each model's config (sources in kvlab/data/reference_presets.md)
CONTEXT = {
    "llama-2-7b": 4096,
    "llama-2-70b": 4096,
    "llama-3.1-8b": 131072,
    "llama-3.1-70b": 131072,
    "llama-3.1-405b": 131072,
    "mistral-7b-v0.1": 32768,
    "mixtral-8x7b": 32768,
    "qwen2.5-7b": 131072,
    "qwen3-4b": 40960,
    "qwen3-8b": 40960,
    "qwen3-32b": 40960,
    "gemma-2-9b": 8192,
    "gemma-3-27b": 131072,
    "deepseek-v3": 163840,
    "gpt-oss-20b": 131072,
    "gpt-oss-120b": 131072,
    "smollm2-135m": 8192,
    "gpt2-small": 1024,
}


@pytest.mark.parametrize(("name", "context"), CONTEXT.items())
def test_each_preset_has_its_models_context_length(name, context):
    assert get_model(name).max_seq_len == context


def test_presets_ship_in_their_checkpoints_dtypes():
    assert dict(get_model("deepseek-v3").weight_dtypes) == {"embeddings": "bf16", "experts": "fp8", "other": "fp8"}
    assert dict(get_model("gpt-oss-120b").weight_dtypes) == {"experts": "mxfp4"}
    assert get_model("mixtral-8x7b").weight_dtypes is None and get_model("mixtral-8x7b").dtype == "bf16"


def test_rtx_4090_tensor_figures_say_their_accumulate_precision():
    gpu = get_gpu("rtx-4090")
    assert (gpu.bf16_tflops, gpu.fp8_tflops) == (165.2, 330.3)
    assert "FP32 accumulate" in gpu.tflops_note and "FP16 accumulate" in gpu.tflops_note


# tie_word_embeddings in each model's config.json, or the model code where the config is silent (sources in
# kvlab/data/reference_presets.md, "Tied embeddings")
TIED = {
    "llama-2-7b": False,
    "llama-2-70b": False,
    "llama-3.1-8b": False,
    "llama-3.1-70b": False,
    "llama-3.1-405b": False,
    "mistral-7b-v0.1": False,
    "mixtral-8x7b": False,
    "qwen2.5-7b": False,
    "qwen3-4b": True,
    "qwen3-8b": False,
    "qwen3-32b": False,
    "gemma-2-9b": True,
    "gemma-3-27b": True,
    "deepseek-v3": False,
    "gpt-oss-20b": False,
    "gpt-oss-120b": False,
    "smollm2-135m": True,
    "gpt2-small": True,
}


def test_every_real_preset_says_whether_it_ties_its_embeddings():
    real = [n for n in model_presets() if n not in ("cpu-tiny", "cpu-small") and not draft_of(n)]
    assert sorted(real) == sorted(TIED)
    for name, tied in TIED.items():
        assert get_model(name).tie_embeddings is tied, name


def test_gemma_3_27b_ties_its_embeddings_and_has_its_published_count():
    """Gemma 3 technical report (arXiv 2503.19786), table 1: 1,416M embedding + 25,600M non-embedding parameters."""
    cfg = get_model("gemma-3-27b")
    assert param_count(cfg) / 1e9 == pytest.approx((1416 + 25600) / 1e3, abs=0.05)
    assert weight_bytes(cfg) / 1e9 == pytest.approx(54.0, abs=0.05)
    h100 = get_gpu("h100-sxm")
    p = predict(cfg, 32768, h100.bandwidth_gbps, batch=8)
    assert p.weight_bytes + p.kv_bytes <= h100.memory_gb * 1e9  # batch 8 fits at 32k


def test_deepseek_v3_mtp_draft_has_the_published_module_size():
    """README_WEIGHTS.md of deepseek-ai/DeepSeek-V3: 11.5B unique parameters besides the shared 0.9B embedding and
    0.9B head, 2.4B of them active."""
    mtp, target = get_model("deepseek-v3-mtp"), get_model("deepseek-v3")
    shared = 2 * mtp.vocab_size * mtp.d_model
    assert (param_count(mtp) - shared) / 1e9 == pytest.approx(11.5, abs=0.05)
    assert active_params(mtp, 1, "table") / 1e9 == pytest.approx(2.4, abs=0.05)
    assert draft_of("deepseek-v3-mtp") == "deepseek-v3" and same_vocabulary(target, mtp) is None


def test_every_gpu_preset_has_a_hardware_class():
    assert {g.hardware_class for g in gpu_presets().values()} <= set(HARDWARE_CLASSES)
    assert get_gpu("h100-sxm").hardware_class == "datacenter-gpu"
    assert get_gpu("rtx-4090").hardware_class == "consumer-gpu"
    assert get_gpu("apple-m2-max").hardware_class == "apple"
