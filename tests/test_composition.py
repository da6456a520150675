"""Storage x policy x codec: every combination a model's own shape asks for builds, decodes, and counts its bytes.

``Decoder.new_cache(kv_dtype=...)`` picks the storage from the model (contiguous slab, a window cache for local
layers, MLA's latent slab) and the codec from ``kv_dtype``. Each is checked against ``model.forward`` (the same
logits with no cache), and its bytes against the arithmetic written out here. The per-component references
(a policy against a masked full cache, a codec against its decoded K/V) live in each cache's own tests.

No silent window: every cache, put under a model whose layers have sliding windows, either gives forward's
logits or refuses with a ValueError. None may read past a window and return something else.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from kvlab.cache import (
    CacheShape,
    ContiguousKVCache,
    HeavyHitterKVCache,
    PagedKVCache,
    QuantizedKVCache,
    SharedPrefixKVCache,
    WindowKVCache,
)
from kvlab.model.decoder import Decoder
from kvlab.spec.config import MLAConfig, ModelConfig
from kvlab.spec.dtypes import KV_DTYPES

BASE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64)
MODELS = {
    "gqa": ModelConfig(**BASE),
    "local-global": ModelConfig(**BASE, layer_windows=(4, None)),
    "mla": ModelConfig(**BASE, mla=MLAConfig(kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
}
CODECS = list(KV_DTYPES)
GROUP = 32  # the stores' default: channels per scale

# Largest logit difference from forward, as a share of the logits' spread, that each codec may cause. From its
# resolution: fp32 exact up to kernel rounding; bf16 keeps 8 mantissa bits (0.4% per element) and fp16 11;
# int8 splits each 32-channel group's range in 255 steps (0.2% of the range per element); fp8 e4m3 keeps 3
# mantissa bits (6%); int4 splits the range in 15 steps (3.3%). Errors of single elements partly average out over
# a dot product, and logits pass through two layers, so each bound is several times its per-element figure.
REL_TOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2, "int8": 3e-2, "fp8": 0.2, "fp8-tensor": 0.2, "int4": 0.3}


def _stored_row_bytes(codec: str, dim: int) -> float:
    """Bytes one token's ``dim`` channels of one head take in ``codec``: payload, plus per-group scales."""
    groups = math.ceil(dim / GROUP)
    return {
        "fp32": 4 * dim,
        "fp16": 2 * dim,
        "bf16": 2 * dim,
        "fp8": dim + 2 * groups,  # e4m3 payload + one fp16 scale per group
        "fp8-tensor": dim,  # e4m3 payload; its one scale per tensor is a constant, not stored
        "int8": dim + 4 * groups,  # payload + fp16 scale + fp16 zero point per group
        "int4": math.ceil(dim / 2) + 4 * groups,  # two codes per byte
    }[codec]


@torch.inference_mode()
def _decode_all(model: Decoder, cache, tokens: torch.Tensor, n_prefill: int) -> torch.Tensor:
    out = [model.prefill(tokens[:, :n_prefill], cache)]
    for i in range(n_prefill, tokens.shape[1]):
        out.append(model.decode_step(tokens[:, i], cache)[:, None])
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", list(MODELS))
def test_new_cache_builds_every_codec_for_the_models_own_shape(name: str, codec: str) -> None:
    cfg = MODELS[name]
    model = Decoder(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    want = model.forward(tokens).detach()
    cache = model.new_cache(2, 16, kv_dtype=codec)
    got = _decode_all(model, cache, tokens, 9)
    spread = float(want.max() - want.min())
    err = float((got - want).abs().max())
    assert err <= REL_TOL[codec] * spread, f"{name}/{codec}: max |logits - forward| {err:.3g}, spread {spread:.3g}"

    # Bytes, counted by hand: per token and layer, K and V rows of every KV head (MLA: one latent, stored once).
    if cfg.mla is None:
        per_layer_token = 2 * cfg.n_kv_heads * _stored_row_bytes(codec, cfg.head_dim)
    else:
        per_layer_token = _stored_row_bytes(codec, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    assert cache.bytes_per_token == pytest.approx(cfg.n_layers * per_layer_token)
    windows = cfg.layer_windows or (None,) * cfg.n_layers
    held = sum(14 if w is None else min(14, w) for w in windows)  # tokens each layer keeps after 14
    assert cache.bytes_read_per_step() == round(2 * held * per_layer_token)


def test_more_bits_less_error() -> None:
    """The tolerances above are not vacuous: on one model, int4 errs more than int8, and int8 more than fp32."""
    cfg = MODELS["gqa"]
    model = Decoder(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    want = model.forward(tokens).detach()
    err = {
        c: float((_decode_all(model, model.new_cache(2, 16, kv_dtype=c), tokens, 9) - want).abs().max())
        for c in ("fp32", "int8", "int4")
    }
    assert err["fp32"] < err["int8"] < err["int4"], err


WINDOWED = ModelConfig(**{**BASE, "n_layers": 3}, layer_windows=(4, None, 6))
CACHES_UNDER_WINDOWS = {
    "new_cache": lambda m, b, c: m.new_cache(b, c),
    "contiguous": ContiguousKVCache.for_model,
    "contiguous-int8": functools.partial(ContiguousKVCache.for_model, codec="int8"),
    # Policies that keep every token each layer's window needs (one that evicts more approximates the model on
    # purpose; tests/test_policies.py checks those against a reference with both masks).
    "window-wider-than-layers": functools.partial(WindowKVCache.for_model, window=(10, None, 10)),
    "window-with-sinks": functools.partial(WindowKVCache.for_model, window=(5, None, 7), sinks=2),
    "window-with-sinks-int8": functools.partial(WindowKVCache.for_model, window=(5, None, 7), sinks=2, codec="int8"),
    "h2o": functools.partial(HeavyHitterKVCache.for_model, heavy=16, recent=4),
    "paged": functools.partial(PagedKVCache.for_model, block_size=4),
    "paged-int8": functools.partial(PagedKVCache.for_model, block_size=4, codec="int8"),
    "shared-prefix": SharedPrefixKVCache.for_model,
    "kivi": QuantizedKVCache.for_model,
}


@pytest.mark.parametrize("name", list(CACHES_UNDER_WINDOWS))
def test_no_cache_reads_past_a_layers_window_silently(name: str) -> None:
    """Either forward's logits (the window applied) or a ValueError: never a wrong answer without an error."""
    model = Decoder(WINDOWED, seed=2)
    tokens = torch.randint(0, WINDOWED.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    tokens[1, :7] = tokens[0, :7]  # a shared prompt, which the shared-prefix cache stores once
    want = model.forward(tokens).detach()
    try:
        cache = CACHES_UNDER_WINDOWS[name](model, 2, 20)
        if name == "shared-prefix":
            prompt = model.prefill(tokens[:1, :7], cache)
            cache.branch()
            got = torch.cat((prompt.expand(2, -1, -1), _decode_all(model, cache, tokens[:, 7:], 1)), dim=1)
        else:
            got = _decode_all(model, cache, tokens, 7)
    except ValueError as refusal:
        assert "window" in str(refusal), f"{name} refused, but without naming the window: {refusal}"
        return
    if "int8" in name or name == "kivi":
        tol = REL_TOL["int8"] * float(want.max() - want.min())
        torch.testing.assert_close(got, want, rtol=0, atol=tol)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_cache_is_built_from_a_shape_record() -> None:
    shape = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)
    assert ContiguousKVCache(shape, 1, 8).bytes_allocated() == 2 * 2 * 8 * 2 * 16 * 4
    with pytest.raises(ValueError, match="shape"):
        ContiguousKVCache(2, 1, 8)  # the old positional (n_layers, batch, capacity, ...) form names what changed
    with pytest.raises(ValueError, match="codec"):
        ContiguousKVCache(shape, 1, 8, codec="int3")
    latent = CacheShape(n_layers=2, n_kv_heads=1, head_dim=40, latent_values=32)  # MLA's: V is K's first 32
    for cache in (ContiguousKVCache, PagedKVCache, SharedPrefixKVCache, QuantizedKVCache):
        with pytest.raises(ValueError, match="MLA latent.*LatentKVCache"):
            cache(latent, 1, 8)
