import dataclasses
import itertools

import pytest
import torch
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

from kvlab import CacheCapacityError, Decoder, MLAConfig, ModelConfig, get_model
from kvlab.mla import LatentKVCache, MLAAttention, decode_flops, set_absorb
from kvlab.roofline import kv_bytes_per_step, kv_bytes_per_token, param_count

from .helpers import assert_greedy_picks, tiny_config

MLA = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
LATENT = 32 + 8  # elements one token caches per layer
Q_LORA = pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q-full", "q-lora"])
PATHS = pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "naive"])
# Cached steps vs one forward pass: other matmul shapes and SDPA masks, so other summation orders. At 5x the init
# the logits reach about 3 and differ by up to ~3e-6 (about ten ulps). Attention moves them by O(1) (mla_model).
STEP_TOL = dict(rtol=0, atol=1e-5)
# Absorbed vs naive: W_uk and W_uv are folded into the query and output instead of expanding K and V, so every
# score is a different sum of products; over 64 steps that leaves a few 1e-6.
PATH_TOL = dict(rtol=0, atol=1e-4)


def mla_config(q_lora_rank: int | None = None, **overrides) -> ModelConfig:
    base = dict(n_layers=2, d_model=64, n_heads=4, d_ff=96, vocab_size=97, max_seq_len=128)
    return ModelConfig(**(base | {"mla": dataclasses.replace(MLA, q_lora_rank=q_lora_rank)} | overrides))


def mla_model(q_lora_rank: int | None = None, absorb: bool = True, seed: int = 0, **overrides) -> Decoder:
    """Weights at 5x the default init, so attention moves the logits by O(1).

    At N(0, 0.02), a softmax scale 10% off moved the logits by only ~1e-4, too little for these tolerances to see.
    """
    model = Decoder(mla_config(q_lora_rank, **overrides), device="cpu", seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(5)
    return set_absorb(model, absorb)


def stepwise_logits(model: Decoder, tokens: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Prefill ``tokens[:, :bounds[0]]``, then each chunk up to the next bound, then decode the rest one at a time."""
    cache = model.new_cache(tokens.shape[0], capacity=tokens.shape[1])
    edges = [0, *bounds]
    out = [model.prefill(tokens[:, a:b], cache) for a, b in itertools.pairwise(edges)]
    out += [model.decode_step(tokens[:, t], cache)[:, None] for t in range(bounds[-1], tokens.shape[1])]
    return torch.cat(out, dim=1)


def random_tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@PATHS
@pytest.mark.parametrize("q_lora_rank, prefill", [(None, 1), (24, 6)], ids=["q-full", "q-lora"])
def test_decoding_one_token_at_a_time_matches_one_full_forward(q_lora_rank, prefill, absorb):
    model = mla_model(q_lora_rank, absorb)
    tokens = random_tokens(2, 32, seed=1)
    with torch.no_grad():
        full = model(tokens)
    assert full.shape == (2, 32, 97)
    assert_close(stepwise_logits(model, tokens, [prefill]), full, **STEP_TOL)


@PATHS
def test_chunked_prefill_matches_full_forward(absorb):
    model = mla_model(absorb=absorb)
    tokens = random_tokens(2, 24, seed=2)
    with torch.no_grad():
        assert_close(stepwise_logits(model, tokens, [5, 6, 17, 24]), model(tokens), **STEP_TOL)


@Q_LORA
def test_naive_and_absorbed_paths_agree_over_many_decode_steps(q_lora_rank):
    tokens = random_tokens(2, 64, seed=3)
    absorbed = stepwise_logits(mla_model(q_lora_rank, absorb=True, seed=4), tokens, [4])
    naive = stepwise_logits(mla_model(q_lora_rank, absorb=False, seed=4), tokens, [4])
    assert_close(absorbed, naive, **PATH_TOL)


@pytest.mark.parametrize(
    "absorb, cached", [(True, False), (True, True), (False, True)], ids=["forward", "absorbed", "naive"]
)
def test_attention_depends_only_on_relative_positions(absorb, cached):
    """RoPE on the query and on the shared key: shifting every position by 100 leaves the output as it was."""
    model = mla_model(absorb=absorb)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(14))

    def attend_from(start: int) -> torch.Tensor:
        cache = model.new_cache(2, 9) if cached else None
        if cache is not None:
            cache.reserve(9)
        return model.layers[0].attn(x, *model.rope(torch.arange(start, start + 9)), cache)

    # Angles at positions near 100 carry fp32 rounding ~100x larger than near 0, and cos/sin pass it on.
    with torch.no_grad():
        assert_close(attend_from(100), attend_from(0), rtol=0, atol=1e-4)


def test_scaling_what_feeds_the_latent_norms_changes_nothing():
    """The q latent and c_kv pass through RMSNorm, so scaling the columns of w_down that make them is invisible."""
    model = mla_model(q_lora_rank=24)
    tokens = random_tokens(2, 10, seed=15)
    with torch.no_grad():
        before = model(tokens)
        for block in model.layers:
            block.attn.w_down[:, : 24 + 32].mul_(4.0)  # [q latent | c_kv | k_rope]: all but k_rope
        # Only the norms' eps sees the scale (~1e-4 here); without a norm the logits moved by over 1.
        assert_close(model(tokens), before, rtol=0, atol=1e-3)


def test_generate_gives_the_same_greedy_tokens_on_both_paths():
    model = mla_model()
    prompt = random_tokens(2, 6, seed=5)
    absorbed = model.generate(prompt, 8)
    naive = set_absorb(model, False).generate(prompt, 8)
    assert absorbed.shape == (2, 8) and absorbed.dtype == torch.long
    # Each path's tokens are the other path's greedy picks, fed the same way generate feeds them (a prefill of the
    # prompt, then one decode step per token); ties within PATH_TOL may go either way.
    for path, tokens in ((False, absorbed), (True, naive)):
        logits = stepwise_logits(set_absorb(model, path), torch.cat([prompt, tokens], dim=1), [6])
        assert_greedy_picks(tokens, logits[:, 5:-1], **PATH_TOL)
    assert model.generate(prompt[0], 4, temperature=1.0, top_k=10, seed=6).shape == (4,)


def test_half_precision_decode_stays_close_to_fp32():
    tokens = random_tokens(1, 12, seed=7)
    ref = mla_model(seed=8)
    with torch.no_grad():
        expected = ref(tokens)
    bf16 = Decoder(ref.cfg.replace(dtype="bf16"), device="cpu")
    bf16.load_state_dict(ref.state_dict())
    cache = bf16.new_cache(1, 20)
    assert cache.torch_dtype == torch.bfloat16
    assert_close(stepwise_logits(bf16, tokens, [4]).float(), expected, rtol=0, atol=0.1 * expected.abs().max().item())


def test_the_cache_holds_one_latent_per_token_and_nothing_per_head():
    model = mla_model()
    cache = model.new_cache(3, capacity=50)
    assert isinstance(cache, LatentKVCache)
    model.prefill(random_tokens(3, 11, seed=9), cache)
    k, v = cache.read(1)
    assert k.shape == (3, 1, 11, LATENT) and v.shape == (3, 1, 11, 32)
    assert v.data_ptr() == k.data_ptr()  # the value is the latent's first channels, not a second copy
    assert_close(v.pow(2).mean(-1), torch.ones(3, 1, 11), rtol=0, atol=1e-3)  # c_kv is RMS-normalised (eps aside)
    # Doubling the heads leaves the cache as it was: every head reads the same latent.
    assert mla_model(n_heads=8).new_cache(3, capacity=50).bytes_allocated() == cache.bytes_allocated()


@pytest.mark.parametrize("dtype, size", [("fp32", 4), ("bf16", 2)])
def test_cache_bytes_match_a_hand_count_and_the_byte_model(dtype, size):
    cfg = mla_config(dtype=dtype)
    model = Decoder(cfg, device="cpu")
    cache = model.new_cache(3, capacity=50)
    model.prefill(random_tokens(3, 11, seed=10), cache)
    per_token = 2 * LATENT * size  # layers x (kv_lora_rank + qk_rope_head_dim) x bytes
    assert cache.kv_bytes_per_token == per_token == kv_bytes_per_token(cfg)
    assert cache.bytes_stored() == 3 * 11 * per_token
    assert cache.bytes_allocated() == 3 * 50 * per_token
    assert cache.bytes_written_per_step() == 3 * per_token
    assert cache.bytes_read_per_step() == 3 * 11 * per_token == kv_bytes_per_step(cfg, 11, batch=3)
    assert cache.bytes_read_per_step(40) == kv_bytes_per_step(cfg, 40, batch=3)


def test_deepseek_v3_caches_70272_bytes_per_token_and_the_latent_cache_agrees():
    cfg = get_model("deepseek-v3")
    assert kv_bytes_per_token(cfg) == 70272 == 61 * (512 + 64) * 2
    cache = LatentKVCache(cfg.n_layers, batch_size=2, capacity=1, mla=cfg.mla, dtype="bf16")
    assert cache.kv_bytes_per_token == 70272
    assert cache.bytes_read_per_step(30000) == kv_bytes_per_step(cfg, 30000, batch=2)


@Q_LORA
def test_parameters_are_the_ones_the_byte_model_counts(q_lora_rank):
    model = mla_model(q_lora_rank)
    assert sum(p.numel() for p in model.parameters()) == param_count(model.cfg)


@Q_LORA
@PATHS
def test_decode_flops_equal_what_torch_counts_for_one_step(q_lora_rank, absorb):
    model = mla_model(q_lora_rank, absorb, n_layers=1)
    cache = model.new_cache(2, capacity=40)
    cache.fast_fill(29, generator=torch.Generator().manual_seed(11))
    position = cache.reserve(1)
    cos, sin = model.rope(torch.tensor([position]))
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(12))
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model.layers[0].attn(x, cos, sin, cache)
    flops = decode_flops(model.cfg, context=30)
    assert counter.get_total_flops() == 2 * (flops.absorbed if absorb else flops.naive)  # batch of 2


def test_decode_flops_for_deepseek_v3_by_hand():
    cfg = get_model("deepseek-v3")
    one, more = decode_flops(cfg, 1), decode_flops(cfg, 1001)
    # Per attended token: absorbed 2 x 128 x (2 x 512 + 64); per-head K/V 2 x 128 x (128 + 64 + 128);
    # naive re-expansion 2 x 512 x 128 x (128 + 128).
    assert more.attend_latent - one.attend_latent == 1000 * 278_528
    assert more.attend_expanded - one.attend_expanded == 1000 * 81_920
    assert more.expand - one.expand == 1000 * 33_554_432
    assert one.absorb == 2 * 128 * 512 * (128 + 128)
    assert one.projections == 2 * 7168 * (1536 + 512 + 64) + 2 * 1536 * 128 * 192 + 2 * 128 * 128 * 7168
    assert more.absorbed < more.naive and more.absorption_extra > 0


def test_going_past_capacity_raises_and_leaves_the_cache_unchanged():
    model = mla_model()
    cache = model.new_cache(1, capacity=8)
    model.prefill(torch.zeros(1, 6, dtype=torch.long), cache)
    with pytest.raises(CacheCapacityError, match="6 tokens stored, 3 more requested, capacity 8"):
        model.prefill(torch.zeros(1, 3, dtype=torch.long), cache)
    assert cache.length == 6


def test_fast_fill_then_decode_agrees_on_both_paths():
    model = mla_model()
    cache = model.new_cache(2, capacity=64)
    cache.fast_fill(50, generator=torch.Generator().manual_seed(13), chunk=16)
    assert cache.length == 50
    assert 0.9 < cache.read(1)[0].std().item() < 1.1  # standard-normal latents, every layer
    tokens = torch.tensor([3, 4])
    absorbed = model.decode_step(tokens, cache)
    cache.reset()
    cache.fast_fill(50, generator=torch.Generator().manual_seed(13), chunk=16)
    assert_close(set_absorb(model, False).decode_step(tokens, cache), absorbed, **PATH_TOL)


def test_config_reads_a_transformers_deepseek_config_and_refuses_llama_export():
    hf = dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,  # transformers sets DeepSeek's head_dim to the RoPE width
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        vocab_size=97,
    )
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.head_dim == 24 and cfg.runnable and cfg.attention_kind == "MLA"
    with pytest.raises(ValueError, match="to_hf_config: MLA"):
        cfg.to_hf_config()


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: dataclasses.replace(MLA, kv_lora_rank=0), "mla.kv_lora_rank"),
        (lambda: dataclasses.replace(MLA, qk_rope_head_dim=7), "mla.qk_rope_head_dim"),
        (lambda: dataclasses.replace(MLA, qk_nope_head_dim=-16), "mla.qk_nope_head_dim"),
        (lambda: dataclasses.replace(MLA, v_head_dim=1.5), "mla.v_head_dim"),
        (lambda: dataclasses.replace(MLA, q_lora_rank=0), "mla.q_lora_rank"),
        (lambda: mla_config(head_dim=16), "head_dim"),
        (lambda: LatentKVCache(2, 1, 0, MLA), "capacity"),
        (lambda: LatentKVCache(2, 1, 8, MLA, dtype="int8"), "kv dtype"),
        (lambda: decode_flops(mla_config(), 0), "context"),
        (lambda: decode_flops(tiny_config(), 8), "cfg"),
        (lambda: MLAAttention(tiny_config(), 0), "cfg"),
        (lambda: set_absorb(Decoder(tiny_config(), device="cpu"), True), "model"),
    ],
)
def test_bad_mla_arguments_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        make()


def test_appending_a_value_that_is_not_the_latent_is_refused():
    cache = LatentKVCache(2, 1, 8, MLA)
    cache.reserve(1)
    k = torch.randn(1, 1, 1, LATENT)
    with pytest.raises(ValueError, match="^v: "):
        cache.append(0, k, k[..., :32].clone())
