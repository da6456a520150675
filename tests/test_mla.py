import dataclasses
import itertools

import pytest
import torch
from torch.testing import assert_close

from kvlab import CacheCapacityError, Decoder, MLAConfig, ModelConfig, get_model
from kvlab.cache.base import CacheShape, KVCache
from kvlab.cache.codec.codecs import get_codec
from kvlab.cache.policy.window import WindowKVCache
from kvlab.cache.storage.latent import LatentKVCache
from kvlab.model import set_absorb
from kvlab.model.mla import MLAAttention
from kvlab.roofline import kv_bytes_per_step, kv_bytes_per_token, param_count

from .helpers import assert_greedy_picks, tiny_config

MLA = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
LATENT = 32 + 8  # elements one token caches per layer
SHAPE = CacheShape(n_layers=2, n_kv_heads=1, head_dim=LATENT, latent_values=32)  # mla_model's cache
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


def stepwise_logits(
    model: Decoder, tokens: torch.Tensor, bounds: list[int], kv_dtype: str | None = None, cache: KVCache | None = None
) -> torch.Tensor:
    """Prefill ``tokens[:, :bounds[0]]``, then each chunk up to the next bound, then decode the rest one at a time,
    into ``cache`` (default: the model's own, in ``kv_dtype``)."""
    if cache is None:
        cache = model.new_cache(tokens.shape[0], capacity=tokens.shape[1], kv_dtype=kv_dtype)
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


@pytest.mark.parametrize("q_lora_rank, kv_dtype", [(None, None), (24, None), (None, "int8"), (None, "fp8")], ids=str)
def test_naive_and_absorbed_paths_agree_over_many_decode_steps(q_lora_rank, kv_dtype):
    # With a codec the two paths read the same decoded latents: the naive one all of them through read(), the
    # absorbed one a chunk at a time (online softmax). Layer 1's latents then differ by rounding only, so each
    # encodes to the same codes unless one sits within ~1e-7 of a rounding boundary (none does here; a flipped
    # int8 code would move the logits by ~1e-3, past PATH_TOL).
    tokens = random_tokens(2, 64, seed=3)
    absorbed = stepwise_logits(mla_model(q_lora_rank, absorb=True, seed=4), tokens, [4], kv_dtype)
    naive = stepwise_logits(mla_model(q_lora_rank, absorb=False, seed=4), tokens, [4], kv_dtype)
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
        return model.layers[0].attn(x, model.rope, *model.rope(torch.arange(start, start + 9)), cache)

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
    assert cache.bytes_per_token == per_token == kv_bytes_per_token(cfg)
    assert cache.bytes_stored() == 3 * 11 * per_token
    assert cache.bytes_allocated() == 3 * 50 * per_token
    assert cache.bytes_written_per_step() == 3 * per_token
    assert cache.bytes_read_per_step() == 3 * 11 * per_token == kv_bytes_per_step(cfg, 11, batch=3)
    assert cache.bytes_read_per_step(40) == kv_bytes_per_step(cfg, 40, batch=3)


def test_deepseek_v3_caches_70272_bytes_per_token_and_the_latent_cache_agrees():
    cfg = get_model("deepseek-v3")
    assert kv_bytes_per_token(cfg) == 70272 == 61 * (512 + 64) * 2
    shape = CacheShape(cfg.n_layers, 1, 512 + 64, "bf16", latent_values=512)
    cache = LatentKVCache(shape, batch_size=2, capacity=1)
    assert cache.bytes_per_token == 70272
    assert cache.bytes_read_per_step(30000) == kv_bytes_per_step(cfg, 30000, batch=2)


@Q_LORA
def test_parameters_are_the_ones_the_byte_model_counts(q_lora_rank):
    model = mla_model(q_lora_rank)
    assert sum(p.numel() for p in model.parameters()) == param_count(model.cfg)


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
        (lambda: LatentKVCache(SHAPE, 1, 0), "capacity"),
        (lambda: LatentKVCache(SHAPE, 1, None), "capacity"),
        (lambda: LatentKVCache(SHAPE, 1, 8, codec="int3"), "codec"),
        (lambda: LatentKVCache(CacheShape(2, 1, LATENT), 1, 8), "shape"),
        (lambda: MLAAttention(tiny_config(), 0), "cfg"),
        (lambda: set_absorb(Decoder(tiny_config(), device="cpu"), True), "model"),
    ],
)
def test_bad_mla_arguments_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        make()


def test_appending_a_value_that_is_not_the_latent_is_refused():
    cache = LatentKVCache(SHAPE, 1, 8)
    cache.reserve(1)
    k = torch.randn(1, 1, 1, LATENT)
    with pytest.raises(ValueError, match="^v: "):
        cache.append(0, k, k[..., :32].clone())


def test_a_sliding_window_is_refused():
    cache = LatentKVCache(SHAPE, 1, 8)
    cache.reserve(1)
    k = torch.randn(1, 1, 1, LATENT)
    cache.append(0, k, k[..., :32])
    with pytest.raises(ValueError, match="^layer_window: 4 .*LatentKVCache"):
        cache.attend(0, torch.randn(1, 1, 4, 1, LATENT), layer_window=4)


class DecodedLatents(LatentKVCache):
    """An fp32 latent cache holding what ``codec`` gives back for each latent: the reference for an encoded one."""

    def __init__(self, shape: CacheShape, batch_size: int, capacity: int, codec: str) -> None:
        super().__init__(shape, batch_size, capacity)
        self.round_trip = get_codec(codec)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k = self.round_trip.decode(self.round_trip.encode(k, -1, 32))  # each latent alone, 32 channels per scale
        super().append(layer, k, k[..., : self.shape.latent_values])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4"])
@PATHS
def test_an_encoded_latent_cache_attends_as_fp32_over_the_decoded_latents(kv_dtype, absorb):
    # One layer, so its latents depend on the tokens alone and both caches encode exactly the same numbers. What is
    # left is the kernels: one softmax over the decoded slab against a chunked online softmax, as STEP_TOL allows.
    model = mla_model(absorb=absorb, n_layers=1)
    tokens = random_tokens(2, 30, seed=17)
    reference = DecodedLatents(CacheShape.from_config(model.cfg, model.device), 2, 30, kv_dtype)
    expected = stepwise_logits(model, tokens, [5, 9], cache=reference)
    assert_close(stepwise_logits(model, tokens, [5, 9], kv_dtype), expected, **STEP_TOL)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_int8_and_fp8_latents_move_the_logits_by_about_their_own_error(kv_dtype):
    """Through ``model.new_cache(kv_dtype=...)``, against the fp32 latent cache over the same tokens.

    The tolerance is the codec's own error on these latents: ``e``, the relative error (norm of the error over
    the norm) of encoding and decoding every latent the fp32 cache holds. The attention output is linear in the
    values (the latents) and the scores in the keys, so a relative error ``e`` in every cached latent moves the
    logits by about ``e`` relative to them: over three seeds and int8/fp8/int4 the logits moved by 0.96 to 1.25
    times ``e`` (int8: e = 0.46%, fp8: 2.4%). Allowed: between e / 2 and 2e. Both bounds can fail: a wrong scale
    or zero point moves the logits by O(1), and a cache that silently stored fp32 would not move them at all.
    """
    model = mla_model()
    tokens = random_tokens(2, 32, seed=16)
    exact_cache = model.new_cache(2, 32)
    exact = stepwise_logits(model, tokens, [4], cache=exact_cache)
    cache = model.new_cache(2, 32, kv_dtype=kv_dtype)
    assert isinstance(cache, LatentKVCache) and cache.codec == kv_dtype
    got = stepwise_logits(model, tokens, [4], cache=cache)
    codec = get_codec(kv_dtype)
    latents = torch.cat([exact_cache.read(layer)[0] for layer in range(2)])
    e = (codec.decode(codec.encode(latents, -1, 32)) - latents).norm() / latents.norm()
    moved = (got - exact).norm() / exact.norm()
    assert e / 2 <= moved <= 2 * e, f"logits moved by {moved:.4f} of their norm; the latents by {e:.4f}"


@pytest.mark.parametrize("group_size", [32, 8])
@pytest.mark.parametrize(("kv_dtype", "n_stats"), [("int8", 2), ("fp8", 1)])  # int8: scale + zero; fp8: a scale
def test_encoded_latent_bytes_match_a_hand_count(kv_dtype, n_stats, group_size):
    model = mla_model()
    cache = LatentKVCache.for_model(model, 3, 50, codec=kv_dtype, group_size=group_size)
    model.prefill(random_tokens(3, 11, seed=18), cache)
    # Per token per layer: r + p = 40 one-byte codes, and per group of channels n_stats fp16 (2 B) statistics.
    # Group 32: 40 channels make 2 groups (32 + a ragged 8, which costs a whole group's stats): 40 + 2 x 2 x n_stats.
    # Group 8: 5 groups: 40 + 5 x 2 x n_stats, what the byte model counts (it assumes whole groups).
    groups = {32: 2, 8: 5}[group_size]
    per_layer = 40 + groups * 2 * n_stats
    assert cache.bytes_per_token == 2 * per_layer  # 2 layers; the value is the latent's first 32 codes, not stored
    assert cache.element_bytes == per_layer / 40
    assert cache.bytes_stored() == 3 * 11 * 2 * per_layer
    assert cache.bytes_allocated() == 3 * 50 * 2 * per_layer
    assert cache.bytes_read_per_step() == 3 * 11 * 2 * per_layer
    assert cache.bytes_written_per_step() == 3 * 2 * per_layer
    if group_size == 8:
        assert cache.bytes_per_token == kv_bytes_per_token(model.cfg, kv_dtype, group_size=8)


@pytest.mark.parametrize(("window", "sinks"), [(4, 0), (4, 2), (6, 3), (1, 1)])
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_window_and_sinks_over_latents_equal_attention_over_exactly_the_kept_latents(window, sinks, codec):
    """WindowKVCache on MLA's latent shape: each query, at prefill chunks that evict their own first tokens and at
    decode steps, equals a softmax over exactly the latents at the positions StreamingLLM keeps for it (the first
    ``sinks`` and the ``window`` newest, itself included), read back from a cache that keeps every latent."""
    gen = torch.Generator().manual_seed(0)
    r, heads, b = SHAPE.latent_values, 3, 2
    cache = WindowKVCache(SHAPE, b, window=window, sinks=sinks, codec=codec)
    every = LatentKVCache(SHAPE, b, capacity=40, codec=codec)  # the same encoding, every latent kept
    for n_new in (7, 5, 1, 1, 9, 1, 1):
        start = cache.reserve(n_new)
        assert every.reserve(n_new) == start
        q = torch.randn(b, 1, heads, n_new, LATENT, generator=gen)
        for layer in range(SHAPE.n_layers):
            latent = torch.randn(b, n_new, 1, LATENT, generator=gen)
            cache.append(layer, latent, latent[..., :r])
            every.append(layer, latent, latent[..., :r])
            got = cache.attend(layer, q)
            stored = every.read(layer)[0][:, 0]  # [B, n, r + p], decoded as the window cache decodes them
            for t in range(n_new):
                p = start + t
                kept = [k for k in range(p + 1) if k < sinks or k > p - window]
                keys = stored[:, kept]  # [B, n_kept, r + p]
                probs = torch.softmax(q[:, 0, :, t] @ keys.transpose(-1, -2), dim=-1)  # [B, H, n_kept]
                assert_close(got[:, 0, :, t], probs @ keys[..., :r], rtol=1e-5, atol=1e-5)
    assert cache.length == min(cache.n_seen, sinks + window)


def test_a_windowed_latent_cache_reads_the_bytes_the_roofline_predicts_and_decodes_a_model():
    model = mla_model()
    window, sinks, n = 5, 2, 19
    cache = WindowKVCache.for_model(model, 1, window=window, sinks=sinks)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    whole = stepwise_logits(model, tokens, [n - 4], cache=cache)
    assert cache.bytes_read_per_step() == kv_bytes_per_step(model.cfg, n, window=window, sinks=sinks)
    assert cache.bytes_stored() == (sinks + window) * kv_bytes_per_token(model.cfg)
    # A prefill chunk gives each of its queries its own window: it equals feeding the tokens one at a time.
    fresh = WindowKVCache.for_model(model, 1, window=window, sinks=sinks)
    one_by_one = stepwise_logits(model, tokens, [1], cache=fresh)
    assert_close(whole, one_by_one, **STEP_TOL)
    with pytest.raises(ValueError, match="^cache: WindowKVCache with absorb=False"):
        stepwise_logits(set_absorb(model, False), tokens, [n], cache=WindowKVCache.for_model(model, 1, window=window))
