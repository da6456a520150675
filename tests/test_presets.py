"""Presets against the models' own configs: context lengths and shipped weight formats."""

import pytest

from kvlab import get_model
from kvlab.presets import get_gpu

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
