import math

import pytest

from kvlab import ModelConfig, get_gpu, get_model
from kvlab.roofline import (
    bytes_per_step,
    kv_bytes_per_step,
    kv_bytes_per_token,
    measure_bandwidth,
    measure_matmul_flops,
    param_count,
    predict,
    predict_tpot_ms,
    weight_bytes,
    weight_bytes_read,
)


def test_worked_example_llama_3_1_70b_on_h100_matches_numbers_md():
    """numbers.md: 327,680 B/token, 9.83 GB at 30k, 141.1 GB of weights, 45.1 ms, weights alone 42.1 ms."""
    p = predict(get_model("llama-3.1-70b"), context=30000, bandwidth_gbps=get_gpu("h100-sxm").bandwidth_gbps)
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert p.kv_bytes == 327_680 * 30_000
    assert round(p.kv_bytes / 1e9, 2) == 9.83
    assert round(p.weight_bytes / 1e9, 1) == 141.1
    assert round(p.tpot_ms, 1) == 45.1
    assert round(p.tpot_ms_weights_only, 1) == 42.1


def test_batch_that_turns_42_ms_into_120_ms():
    cfg, bw = get_model("llama-3.1-70b"), get_gpu("h100-sxm").bandwidth_gbps
    batch = (0.120 * bw * 1e9 - weight_bytes(cfg)) / kv_bytes_per_step(cfg, 30000)
    assert round(batch, 1) == 26.5
    assert predict(cfg, 30000, bw, batch=26).tpot_ms < 120 < predict(cfg, 30000, bw, batch=27).tpot_ms


def test_mha_variant_of_the_70b_example():
    cfg = get_model("llama-3.1-70b").replace(n_kv_heads=64)
    assert round(kv_bytes_per_token(cfg) / 1e6, 2) == 2.62
    assert round(kv_bytes_per_step(cfg, 30000) / 1e9, 1) == 78.6


def test_kv_bytes_per_token_for_each_attention_kind():
    assert kv_bytes_per_token(get_model("llama-2-7b")) == 512 * 1024
    assert kv_bytes_per_token(get_model("qwen2.5-7b")) == 56 * 1024
    assert kv_bytes_per_token(get_model("smollm2-135m")) == 22.5 * 1024
    assert kv_bytes_per_token(get_model("deepseek-v3")) == 61 * 576 * 2 == 70_272
    mqa = get_model("llama-3.1-8b").replace(n_kv_heads=1)
    assert kv_bytes_per_token(mqa) == 2 * 32 * 1 * 128 * 2
    assert kv_bytes_per_token(get_model("llama-3.1-8b"), "int4") == 2 * 32 * 8 * 128 // 2


def test_local_layers_read_at_most_their_window():
    gemma2 = get_model("gemma-2-9b")  # 21 local layers (window 4096) + 21 global
    per_layer_token = 2 * 8 * 256 * 2
    assert kv_bytes_per_step(gemma2, 2000) == 42 * 2000 * per_layer_token
    assert kv_bytes_per_step(gemma2, 32768) == (21 * 4096 + 21 * 32768) * per_layer_token
    oss = get_model("gpt-oss-20b")
    assert kv_bytes_per_step(oss, 10_000, batch=3) == 3 * (12 * 128 + 12 * 10_000) * 2 * 8 * 64 * 2


def test_parameter_counts_reproduce_published_figures():
    for name, published in [
        ("llama-3.1-8b", 8.03e9),
        ("llama-2-7b", 6.74e9),
        ("qwen3-32b", 32.76e9),
        ("gemma-2-9b", 9.24e9),
        ("smollm2-135m", 0.1345e9),
    ]:
        assert param_count(get_model(name)) == pytest.approx(published, rel=2e-3), name
    cfg = ModelConfig(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, d_ff=16, vocab_size=10)
    attn = 8 * 8 + 2 * 8 * 4 + 8 * 8
    assert param_count(cfg) == 2 * 10 * 8 + 2 * (attn + 3 * 8 * 16 + 2 * 8) + 8
    assert param_count(cfg.replace(tie_embeddings=True)) == param_count(cfg) - 80


def test_weight_bytes_read_counts_one_embedding_row_per_sequence():
    cfg = get_model("llama-3.1-8b")
    embedding = 128256 * 4096 * 2
    assert weight_bytes(cfg) - weight_bytes_read(cfg) == embedding - 4096 * 2
    assert weight_bytes_read(cfg, batch=4) - weight_bytes_read(cfg) == 3 * 4096 * 2
    tied = get_model("qwen3-4b")
    assert weight_bytes_read(tied) == weight_bytes(tied)
    moe = get_model("mixtral-8x7b")
    assert weight_bytes(moe) == 46.70e9 * 2
    assert weight_bytes_read(moe) == round(12.88e9 * 2 - (32000 - 1) * 4096 * 2)


def test_bytes_per_step_and_tpot_compose():
    cfg = get_model("llama-3.1-8b")
    total = bytes_per_step(cfg, 8192, batch=4, weight_dtype="fp8", kv_dtype="int8")
    assert total == weight_bytes(cfg, "fp8") + 4 * 8192 * kv_bytes_per_token(cfg, "int8")
    assert predict_tpot_ms(2e9, 1000) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="bandwidth"):
        predict_tpot_ms(1, 0)
    with pytest.raises(ValueError, match="kv_dtype: unknown dtype 'fp7'"):
        kv_bytes_per_token(cfg, "fp7")
    with pytest.raises(ValueError, match="batch"):
        kv_bytes_per_step(cfg, 10, batch=0)


def test_measured_ceilings_are_positive_and_consistent():
    bw = measure_bandwidth("cpu", size_mb=16, repeats=3)
    for value in (bw.copy_gbps, bw.read_gbps):
        assert math.isfinite(value) and value > 0
    assert bw.copy_best_gbps >= bw.copy_gbps and bw.read_best_gbps >= bw.read_gbps
    assert measure_matmul_flops("cpu", n=128, repeats=2) > 0


def test_window_and_sinks_bound_what_a_step_reads():
    cfg = get_model("llama-3.1-8b")
    per_token = kv_bytes_per_token(cfg)
    assert kv_bytes_per_step(cfg, 32768, window=1020, sinks=4) == 1024 * per_token
    assert kv_bytes_per_step(cfg, 500, window=1020, sinks=4) == 500 * per_token  # nothing evicted yet
    assert kv_bytes_per_step(cfg, 32768, window=1020, sinks=4) == kv_bytes_per_step(cfg, 65536, window=1020, sinks=4)
    with pytest.raises(ValueError, match="sinks: only meaningful with a window"):
        kv_bytes_per_step(cfg, 100, sinks=4)
    with pytest.raises(ValueError, match="window"):
        kv_bytes_per_step(cfg, 100, window=0)


def test_a_policy_window_on_a_local_layer_reads_the_intersection():
    gemma2 = get_model("gemma-2-9b")  # 21 local layers (window 4096), 21 global
    per_layer_token = 2 * 8 * 256 * 2
    # local layers: the sinks lie outside their 4096 window, so only the 1020 recent tokens remain
    expected = (21 * 1020 + 21 * (4 + 1020)) * per_layer_token
    assert kv_bytes_per_step(gemma2, 32768, window=1020, sinks=4) == expected


def test_shared_prefix_is_read_once_per_batch():
    cfg = get_model("llama-3.1-8b")
    per_token = kv_bytes_per_token(cfg)
    assert kv_bytes_per_step(cfg, 20000, batch=8, shared_prefix=16000) == (16000 + 8 * 4000) * per_token
    assert kv_bytes_per_step(cfg, 20000, batch=1, shared_prefix=16000) == kv_bytes_per_step(cfg, 20000)
    # with a window, only the sinks remain of the prefix
    assert (
        kv_bytes_per_step(cfg, 20000, batch=8, window=1000, sinks=4, shared_prefix=16000) == (4 + 8 * 1000) * per_token
    )
    with pytest.raises(ValueError, match="shared_prefix"):
        kv_bytes_per_step(cfg, 100, shared_prefix=101)


def test_group_size_counts_scales_and_zero_points_as_the_codecs_store_them():
    from kvlab.roofline import kv_element_bytes

    assert kv_element_bytes("int8", 64) == 1 + (2 + 2) / 64  # fp16 scale and zero point per group
    assert kv_element_bytes("int4", 32) == 0.5 + 4 / 32
    assert kv_element_bytes("fp8", 32) == 1 + 2 / 32  # a scale, no zero point
    assert kv_element_bytes("bf16", 32) == kv_element_bytes("bf16") == 2
    cfg = get_model("llama-3.1-8b")
    assert kv_bytes_per_token(cfg, "int4", group_size=32) == 2 * 32 * 8 * 128 * 0.625
    with pytest.raises(ValueError, match="group_size"):
        kv_element_bytes("int8", 0)


def test_byte_model_agrees_with_a_quantized_cache_with_no_residual():
    from kvlab import Decoder
    from kvlab.cache import QuantizedKVCache

    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=50, max_seq_len=256)
    model = Decoder(cfg, device="cpu")
    for codec in ("int8", "int4", "fp8"):
        cache = QuantizedKVCache(2, 1, 128, 2, 16, codec=codec, group_size=16, residual=0)
        cache.fast_fill(64)
        assert cache.bytes_stored() == 64 * kv_bytes_per_token(model.cfg, codec, group_size=16), codec
