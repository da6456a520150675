import pytest
import torch
from torch.testing import assert_close

from kvlab import CacheCapacityError, ContiguousKVCache, Decoder
from kvlab.cache import CacheShape

from .helpers import assert_greedy_picks, tiny_config

# Decode runs its own matvec and softmax over the cache, a chunked prefill masked SDPA, a full forward SDPA's causal
# kernel: each sums in another order, so the logits (|x| < 1 at this init) differ by a few fp32 ulps, more after the
# 40 positions and two layers they pass through. A wrong mask or a position off by one moves them by about 1e-3 or
# more (see the window test below).
PATH_TOL = dict(rtol=1e-5, atol=1e-5)
# In bf16 (the CUDA runs, and cpu-bf16) every stored activation is rounded to 8 bits, 2^-9 of itself: two paths that
# sum in other orders part by a few bf16 ulps on logits near 1 (0.008 seen on CPU). 0.03 allows several, and stays
# 3x below what the window test's wrong mask moves (0.1).
BF16_PATH_TOL = dict(rtol=0, atol=3e-2)


def _incremental_logits(model: Decoder, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    cache = model.new_cache(tokens.shape[0], capacity=tokens.shape[1])
    steps = [model.prefill(tokens[:, :prefill], cache)]
    steps += [model.decode_step(tokens[:, t], cache)[:, None] for t in range(prefill, tokens.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("prefill", [1, 7])
def test_decoding_one_token_at_a_time_matches_one_full_forward(n_kv_heads, prefill, target):
    model = Decoder(tiny_config(n_kv_heads=n_kv_heads, dtype=target.dtype), device=target.device)
    tokens = torch.randint(0, 101, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
    assert full.shape == (3, 40, 101)
    assert_close(_incremental_logits(model, tokens, prefill), full, **target.tol(PATH_TOL, BF16_PATH_TOL))


def test_chunked_prefill_matches_full_forward(target):
    model = Decoder(tiny_config(dtype=target.dtype), device=target.device)
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(2, 30)
    chunks = [model.prefill(tokens[:, a:b], cache) for a, b in ((0, 11), (11, 12), (12, 30))]
    with torch.no_grad():
        assert_close(torch.cat(chunks, dim=1), model(tokens), **target.tol(PATH_TOL, BF16_PATH_TOL))


def test_gqa_with_as_many_kv_heads_as_heads_is_mha():
    """A GQA model equals the MHA model whose K/V projections repeat each KV head for its query group."""
    gqa = Decoder(tiny_config(n_kv_heads=2), device="cpu", seed=3)
    mha = Decoder(tiny_config(n_kv_heads=4), device="cpu", seed=4)
    cfg, hd = gqa.cfg, gqa.cfg.head_dim
    state = gqa.state_dict()
    for i in range(cfg.n_layers):
        w = state[f"layers.{i}.attn.wqkv"]
        q, k, v = w.split([cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd], dim=1)
        repeat = [
            t.view(cfg.d_model, cfg.n_kv_heads, 1, hd).expand(-1, -1, cfg.n_groups, -1).reshape(cfg.d_model, -1)
            for t in (k, v)
        ]
        state[f"layers.{i}.attn.wqkv"] = torch.cat([q, *repeat], dim=1)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 101, (2, 25), generator=torch.Generator().manual_seed(5))
    # The same numbers, but MHA's projection is wider and SDPA/decode group the heads differently: to rounding.
    with torch.no_grad():
        assert_close(mha(tokens), gqa(tokens), **PATH_TOL)
    assert_close(_incremental_logits(mha, tokens, 5), _incremental_logits(gqa, tokens, 5), **PATH_TOL)


def test_grouped_decode_kernel_matches_a_naive_per_head_reference():
    from kvlab.kernels.reference import decode_attention

    g = torch.Generator().manual_seed(6)
    b, hkv, groups, d, s = 2, 3, 4, 16, 50
    q, k, v = (
        torch.randn(b, hkv, groups, d, generator=g),
        torch.randn(b, hkv, s, d, generator=g),
        torch.randn(b, hkv, s, d, generator=g),
    )
    out = decode_attention(q, k.transpose(-1, -2).contiguous(), v)
    for h in range(hkv * groups):
        kv = h // groups
        weights = torch.softmax(torch.einsum("bd,bsd->bs", q[:, kv, h % groups], k[:, kv]), dim=-1)
        # matmul vs einsum over 50 tokens (|v| < 4): an output near 0 can be off by up to ~50 x 2^-24 x 4 = 1.2e-5
        # (1.3e-6 seen); attending with the wrong KV head or group is O(1) off.
        assert_close(out[:, kv, h % groups], torch.einsum("bs,bsd->bd", weights, v[:, kv]), rtol=1e-5, atol=1e-5)


def test_going_past_capacity_raises_and_leaves_the_cache_unchanged():
    model = Decoder(tiny_config(), device="cpu")
    cache = model.new_cache(1, capacity=8)
    model.prefill(torch.zeros(1, 6, dtype=torch.long), cache)
    with pytest.raises(CacheCapacityError, match="6 tokens stored, 3 more requested, capacity 8"):
        model.prefill(torch.zeros(1, 3, dtype=torch.long), cache)
    assert cache.length == 6
    model.decode_step(torch.zeros(1, dtype=torch.long), cache)
    assert cache.length == 7


def test_cache_reports_its_bytes():
    cache = ContiguousKVCache(CacheShape(n_layers=3, n_kv_heads=2, head_dim=8, dtype="bf16"), 2, 10)
    per_token = 2 * 3 * 2 * 8 * 2  # K and V, layers, KV heads, head dim, bytes
    assert cache.bytes_per_token == per_token
    cache.fast_fill(4)
    assert cache.length == 4
    assert cache.bytes_stored() == 2 * 4 * per_token
    assert cache.bytes_allocated() == 2 * 10 * per_token
    assert cache.bytes_read_per_step() == 2 * 4 * per_token
    assert cache.bytes_read_per_step(context=9) == 2 * 9 * per_token
    assert cache.bytes_written_per_step() == 2 * per_token
    k, v = cache.read(1)
    assert k.shape == v.shape == (2, 2, 4, 8)


def test_generate_greedy_equals_argmax_of_the_full_forward(target):
    model = Decoder(tiny_config(dtype=target.dtype), device=target.device)
    prompt = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(7)).to(target.device)
    new = model.generate(prompt, max_new_tokens=10)
    assert new.shape == (2, 10)
    seq = torch.cat([prompt, new], dim=1)
    with torch.no_grad():
        # generate decodes through the cache, the forward pass does not: their logits agree to PATH_TOL.
        assert_greedy_picks(new, model(seq)[:, 5:-1].float(), **target.tol(PATH_TOL, BF16_PATH_TOL))
    assert model.generate(prompt[0].tolist(), 4).shape == (4,)
    assert model.generate(prompt, 0).shape == (2, 0)


def test_greedy_picks_accept_the_argmax_and_ties_within_rounding_only():
    logits = torch.tensor([[[0.5, 0.2, 0.5 - 1e-6], [0.1, 0.3, 0.0]]])  # [1, 2 positions, 3 ids]
    assert_greedy_picks(torch.tensor([[0, 1]]), logits, rtol=0, atol=1e-5)  # the argmax
    assert_greedy_picks(torch.tensor([[2, 1]]), logits, rtol=0, atol=1e-5)  # 1e-6 below it: a tie to rounding
    with pytest.raises(AssertionError, match=r"tokens at \[\[0, 0\]\]"):
        assert_greedy_picks(torch.tensor([[1, 1]]), logits, rtol=0, atol=1e-5)  # 0.3 below: wrong
    with pytest.raises(AssertionError, match=r"tokens at \[\[0, 0\]\]"):
        assert_greedy_picks(torch.tensor([[2, 1]]), logits, rtol=0, atol=1e-7)  # a tie no longer, at this tolerance


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy():
    model = Decoder(tiny_config(), device="cpu")
    prompt = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(8))
    # Each pair below runs the same calls on the same data, so the logits match bit for bit and the ids exactly;
    # top_k=1 keeps only the largest logit, which dividing by 0.7 leaves the largest.
    a = model.generate(prompt, 12, temperature=1.0, top_p=0.9, seed=11)
    assert torch.equal(a, model.generate(prompt, 12, temperature=1.0, top_p=0.9, seed=11))
    assert not torch.equal(a, model.generate(prompt, 12, temperature=1.0, top_p=0.9, seed=12))
    assert torch.equal(model.generate(prompt, 8, temperature=0.7, top_k=1, seed=1), model.generate(prompt, 8))


def test_top_p_keeps_the_smallest_set_reaching_p():
    from kvlab.model.sampling import sample_next

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, 1.0, top_p=0.75, generator=g)) for _ in range(300)}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.generate([1, 2], 3, temperature=-1.0), "temperature"),
        (lambda m: m.generate([1, 2], 3, temperature=1.0, top_k=0), "top_k"),
        (lambda m: m.generate([1, 2], 3, temperature=1.0, top_p=1.5), "top_p"),
        (lambda m: m.generate([1, 500], 3), "vocab_size=101"),
        (lambda m: m.generate([], 3), "prompt"),
        (lambda m: m(torch.zeros(1, 200, dtype=torch.long)), "max_seq_len=128"),
        (lambda m: m.decode_step(torch.zeros(1, 2, dtype=torch.long), m.new_cache(1, 4)), "one token"),
        (
            lambda m: m.new_cache(1, 4, kv_dtype="mxfp4"),
            "kv_dtype.*allowed: fp32, fp16, bf16, fp8, fp8-tensor, int8, int4",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call, match):
    model = Decoder(tiny_config(), device="cpu")
    with pytest.raises(ValueError, match=match):
        call(model)


def test_device_is_picked_automatically_and_can_be_overridden():
    from kvlab import default_device

    assert Decoder(tiny_config()).device.type == default_device().type
    assert Decoder(tiny_config(), device="cpu").device.type == "cpu"
    # A GPU this machine lacks is refused by name when the model is built, not at its first tensor.
    with pytest.raises(ValueError, match=r"device: 'cuda:99', but torch .* finds no such device here; allowed: 'cpu'"):
        Decoder(tiny_config(), device="cuda:99")
    with pytest.raises(ValueError, match=r"device: 'gpu' is not a device; allowed: 'cpu'"):
        Decoder(tiny_config(), device="gpu")


@pytest.mark.parametrize("call", ["prefill", "decode_step"])
def test_a_cache_for_another_model_is_refused_naming_what_differs(call):
    model = Decoder(tiny_config(), device="cpu")
    tokens = torch.tensor([[1]])
    other = Decoder(tiny_config(n_layers=3, n_kv_heads=1), device="cpu").new_cache(1, 8)
    with pytest.raises(
        ValueError, match=r"cache: n_layers=3, n_kv_heads=1, but the model has n_layers=2, n_kv_heads=2"
    ):
        getattr(model, call)(tokens, other)
    assert other.length == 0  # refused before a slot was taken
    wider = ContiguousKVCache(CacheShape(2, 2, 32, "bf16"), 1, 8)
    with pytest.raises(
        ValueError, match=r"cache: head_dim=32, dtype='bf16', but the model has head_dim=16, dtype='fp32'"
    ):
        getattr(model, call)(tokens, wider)
    own = model.new_cache(1, 8)
    getattr(model, call)(tokens, own)  # its own passes, and again from the remembered shape
    getattr(model, call)(tokens, own)
    assert own.length == 2


def test_a_model_cast_after_it_was_built_is_refused_with_the_way_to_build_it():
    model = Decoder(tiny_config(), device="cpu")
    cache = model.new_cache(1, 8)
    model.decode_step(torch.tensor([1]), cache)  # accepted once, then the model changes under the same cache
    model.to(torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"model: its parameters are torch.bfloat16, but cfg.dtype is 'fp32'.*"
        r"new = Decoder\(model.cfg.replace\(dtype='bf16'\)\), then new.load_state_dict\(model.state_dict\(\)\)",
    ):
        model.decode_step(torch.tensor([1]), cache)
    with pytest.raises(ValueError, match=r"model: its parameters are torch.bfloat16"):
        model.prefill(torch.tensor([[1, 2]]), model.new_cache(1, 8))  # its new cache follows cfg.dtype
    new = Decoder(model.cfg.replace(dtype="bf16"), device="cpu")  # what the message says, followed literally
    new.load_state_dict(model.state_dict())
    assert new.prefill(torch.tensor([[1, 2]]), new.new_cache(1, 8)).dtype == torch.bfloat16


def test_unrunnable_shapes_are_refused_with_the_reason():
    from kvlab import get_model

    with pytest.raises(ValueError, match="mixtral-8x7b: mixture-of-experts"):
        Decoder(get_model("mixtral-8x7b"))


def test_local_layers_attend_only_to_their_window_with_and_without_a_cache(target):
    windowed = Decoder(tiny_config(layer_windows=(5, None), dtype=target.dtype), device=target.device, seed=12)
    full = Decoder(tiny_config(dtype=target.dtype), device=target.device, seed=12)
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(13))
    tol = target.tol(PATH_TOL, BF16_PATH_TOL)
    with torch.no_grad():
        reference = windowed(tokens)
        # Inside the window the same keys are seen, but through a mask instead of is_causal: equal to rounding.
        assert_close(reference[:, :5], full(tokens)[:, :5], **tol)
        # Past it the window matters: by 0.15, far above either dtype's rounding.
        assert (reference[:, 10:] - full(tokens)[:, 10:]).abs().max() > (1e-3 if target.dtype == "fp32" else 0.1)
    assert_close(_incremental_logits(windowed, tokens, 3), reference, **tol)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_models_decode_close_to_fp32(dtype):
    ref = Decoder(tiny_config(), device="cpu", seed=9)
    half = Decoder(tiny_config(dtype=dtype), device="cpu", seed=9)
    tokens = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(10))
    # bf16 keeps 8 significant bits (fp16 11): each stored activation is off by up to 2^-9 of itself, and bf16
    # matmuls differ between CPUs (native AVX512-BF16 or converted to fp32); 0.05 is several such errors on logits
    # that are below 1, and still 10x below what dropping the attention term changes.
    with torch.no_grad():
        assert_close(_incremental_logits(half, tokens, 4).float(), ref(tokens), rtol=0, atol=0.05)


def test_long_prefills_are_taken_in_query_blocks_with_the_same_result(monkeypatch):
    """A 32k-token prefill would otherwise hold T x T scores per head; blocks must not change the answer."""
    import kvlab.kernels.reference

    model = Decoder(tiny_config(layer_windows=(6, None)), device="cpu")
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_cache(2, 40)
        model.prefill(tokens[:, :9], cache)
        monkeypatch.setattr(kvlab.kernels.reference, "MAX_SCORES", 2 * 4 * 40 * 3)  # three queries per block
        # Blocks of 3 queries run masked SDPA on slices instead of one is_causal call: equal to rounding.
        assert_close(model(tokens), whole, **PATH_TOL)
        assert_close(model.prefill(tokens[:, 9:], cache), whole[:, 9:], **PATH_TOL)


def test_a_cache_may_return_one_start_per_sequence():
    """A ragged batch's cache returns a start per sequence (``LongTensor [B]``): the decoder ropes each row at its
    own positions. Rows that happen to share a start must decode exactly as with the int (the same elementwise
    RoPE on the same positions, the same kernels after it)."""

    class PerSequenceStarts(ContiguousKVCache):
        def reserve(self, n_new):
            return torch.full((self.batch_size,), super().reserve(n_new), dtype=torch.long)

    model = Decoder(tiny_config(), device="cpu")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(8))
    logits = {}
    for name, cache in (("int", model.new_cache(2, 12)), ("per-sequence", PerSequenceStarts.for_model(model, 2, 12))):
        out = [model.prefill(tokens[:, :6], cache)[:, -1]]
        out += [model.decode_step(tokens[:, i], cache) for i in range(6, 9)]
        logits[name] = torch.stack(out)
    assert torch.equal(logits["int"], logits["per-sequence"])
