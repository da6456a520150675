"""Retention policies: each equals a full cache with exactly the evicted positions masked, and counts its bytes.

The references here share no code with the policies: a full contiguous cache with an explicit mask built from
Python sets (and the model layer's own window), a brute-force StreamingLLM that re-ropes un-roped keys every step,
and a brute-force H2O oracle.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from kvlab import CacheCapacityError, ContiguousKVCache, Decoder, MLAConfig, ModelConfig
from kvlab.cache.base import CacheShape
from kvlab.cache.policy.heavy_hitters import HeavyHitterKVCache
from kvlab.cache.policy.window import WindowKVCache
from kvlab.model.layers import apply_rope

CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=97, max_seq_len=256)
# The same model with a sliding window of 4 on layer 0 (Gemma-2's local/global pattern).
WINDOWED = ModelConfig(**{**CFG.__dict__, "name": "windowed", "layer_windows": (4, None)})
B, N = 2, 40
# Step sizes: a prefill longer than the small windows, decode steps, a mid-stream chunk, more decode steps.
SCHEDULE = [10] + [1] * 14 + [5] + [1] * 11
# The references attend per head with einsum and an explicit softmax, the caches with grouped matmuls and SDPA: the
# same sums in another order. Logits here reach about 1 (Q/K/V scaled up): a few fp32 ulps after two layers.
# Dropping one kept token moves them by more than 1e-2 (asserted below where it is not obvious).
TOL = dict(rtol=1e-5, atol=1e-5)


def peaked(cfg: ModelConfig) -> Decoder:
    """Random weights with Q/K/V scaled up, so attention is peaked and dropping a token visibly moves the logits."""
    model = Decoder(cfg, device="cpu", seed=0)
    with torch.no_grad():
        for block in model.layers:
            block.attn.wqkv.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def model() -> Decoder:
    return peaked(CFG)


@pytest.fixture(scope="module")
def windowed() -> Decoder:
    return peaked(WINDOWED)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (B, N), generator=torch.Generator().manual_seed(1))


def run(model, cache, tokens, schedule=SCHEDULE, after_step=None) -> torch.Tensor:
    """Feed ``tokens`` by ``schedule`` (1 = a decode step, more = a prefill chunk); logits ``[B, N, V]``."""
    out, start = [], 0
    for n in schedule:
        chunk = tokens[:, start : start + n]
        out.append(model.decode_step(chunk[:, 0], cache)[:, None] if n == 1 else model.prefill(chunk, cache))
        start += n
        if after_step is not None:
            after_step(start)
    assert start == tokens.shape[1]
    return torch.cat(out, dim=1)


def reference_attention(q, k, v, mask=None):
    """Per query head, no grouping tricks. ``q`` ``[B, H, T, D]``, already scaled; ``k``, ``v`` ``[B, Hkv, n, D]``;
    ``mask`` ``[B|1, Hkv|1, T, n]`` (True = visible) -> out ``[B, H, T, D]``, probs ``[B, H, T, n]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", q, k)
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat_interleave(g, dim=1) if mask.shape[1] > 1 else ~mask, -math.inf)
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhts,bhsd->bhtd", probs, v), probs


class MaskedFullCache(ContiguousKVCache):
    """Keeps every token; a query sees key ``a`` only where ``visible(layer, b, h, p, a)`` says so, and the layer's
    own sliding window allows it."""

    def __init__(self, model: Decoder, visible) -> None:
        super().__init__(CacheShape.from_config(model.cfg, model.device), B, N)
        self.visible = visible

    def mask(self, layer: int, t: int, window: int | None) -> torch.Tensor:
        end = self.length

        def sees(b, h, p, a):
            return a <= p and (window is None or a > p - window) and self.visible(layer, b, h, p, a)

        return torch.tensor(
            [
                [[[sees(b, h, p, a) for a in range(end)] for p in range(end - t, end)] for h in range(self.n_kv_heads)]
                for b in range(B)
            ]
        )

    def attend(self, layer: int, q: torch.Tensor, layer_window=None, rotate=None) -> torch.Tensor:
        k, v = self.read(layer)
        b, hkv, g, t, d = q.shape
        out, probs = reference_attention(q.reshape(b, hkv * g, t, d), k, v, self.mask(layer, t, layer_window))
        self.observe(layer, probs)
        return out.view(b, hkv, g, t, -1)

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        """Hook for the H2O oracle."""


def window_keeps(p: int, sinks: int, window: int | None) -> set[int]:
    """Positions a query at ``p`` sees under window + sinks (StreamingLLM's rule, written out)."""
    if window is None:
        return set(range(p + 1))
    return set(range(min(sinks, p + 1))) | set(range(max(0, p - window + 1), p + 1))


def windowed_reference(model, sinks, windows) -> MaskedFullCache:
    return MaskedFullCache(model, lambda layer, b, h, p, a: a in window_keeps(p, sinks, windows[layer]))


# -- (a) window + sinks, original positions == full cache with the evicted positions masked ------------------------
@pytest.mark.parametrize(("sinks", "window"), [(2, 6), (0, 5), (3, 1)])
def test_window_with_original_positions_equals_masked_full_cache(model, tokens, sinks, window):
    cache = WindowKVCache.for_model(model, B, window=window, sinks=sinks)
    got = run(model, cache, tokens)
    want = run(model, windowed_reference(model, sinks, [window] * CFG.n_layers), tokens)
    assert_close(got, want, **TOL)
    # The masking matters: past the first eviction the logits leave the full cache's.
    full = run(model, model.new_cache(B, N), tokens)
    assert (got - full)[:, sinks + window + 1 :].abs().max() > 1e-2


def test_window_stores_the_kept_tokens_keys_and_values(model, tokens):
    """Layer 0's K/V depend only on the token and its position, so they must equal a full cache's, slot by slot."""
    cache, full = WindowKVCache.for_model(model, B, window=5, sinks=2), model.new_cache(B, N)
    run(model, cache, tokens)
    run(model, full, tokens)
    positions = cache.kept_positions(0)
    assert sorted(positions[0, 0].tolist()) == [0, 1, 35, 36, 37, 38, 39]
    k, v = cache.read(0)
    full_k, full_v = full.read(0)
    index = positions[..., None].expand(-1, -1, -1, CFG.head_dim)
    # Both caches were fed the same steps, so layer 0's projection ran on the same rows; the slots hold copies.
    assert_close(k, full_k.gather(2, index), rtol=0, atol=0)
    assert_close(v, full_v.gather(2, index), rtol=0, atol=0)


# -- (b) re-assigned positions == brute-force StreamingLLM ------------------------------------------------------
def streaming_llm_reference(model: Decoder, tokens: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Feed tokens one at a time; keep every token's K/V before RoPE; at each step rope the kept keys at their
    in-cache positions ``0 .. n-1`` and the query at ``n-1``, as StreamingLLM does. Logits ``[B, N, V]``."""
    cfg = model.cfg
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    raw_k = [[] for _ in model.layers]
    raw_v = [[] for _ in model.layers]
    logits = []
    with torch.inference_mode():
        for p in range(tokens.shape[1]):
            kept = sorted(window_keeps(p, sinks, window))
            cos, sin = model.rope(torch.arange(len(kept)))
            x = model.embed(tokens[:, p : p + 1])
            for i, block in enumerate(model.layers):
                q, k, v = (block.attn_norm(x) @ block.attn.wqkv).view(B, 1, h + 2 * hkv, d).split([h, hkv, hkv], 2)
                raw_k[i].append(k)
                raw_v[i].append(v)
                keys = apply_rope(torch.cat([raw_k[i][a] for a in kept], dim=1), cos, sin)
                values = torch.cat([raw_v[i][a] for a in kept], dim=1)
                q = apply_rope(q, cos[-1:], sin[-1:]).transpose(1, 2) / math.sqrt(d)
                out, _ = reference_attention(q, keys.transpose(1, 2), values.transpose(1, 2))
                x = x + out.transpose(1, 2).reshape(B, 1, -1) @ block.attn.wo
                x = x + block.mlp(block.mlp_norm(x))
            logits.append(model._logits(x))
    return torch.cat(logits, dim=1)


def test_streaming_reference_without_eviction_is_the_plain_model(model, tokens):
    with torch.no_grad():
        assert_close(streaming_llm_reference(model, tokens[:, :12], sinks=2, window=20), model(tokens[:, :12]), **TOL)


@pytest.mark.parametrize(("sinks", "window", "schedule"), [(2, 6, SCHEDULE), (4, 3, [1] * N), (1, 8, [20, 20])])
def test_window_with_reassigned_positions_equals_brute_force_streaming_llm(model, tokens, sinks, window, schedule):
    cache = WindowKVCache.for_model(model, B, window=window, sinks=sinks, positions="reassigned")
    got = run(model, cache, tokens, schedule)
    assert_close(got, streaming_llm_reference(model, tokens, sinks, window), **TOL)
    original = run(model, WindowKVCache.for_model(model, B, window=window, sinks=sinks), tokens, schedule)
    assert_close(got[:, : sinks + window], original[:, : sinks + window], **TOL)  # same until the first eviction
    assert (got - original).abs().max() > 1e-2  # then the sinks see the query from a different distance


# -- (c) a window larger than the sequence is the contiguous cache ------------------------------------------------
@pytest.mark.parametrize("positions", ["original", "reassigned"])
def test_window_longer_than_the_sequence_equals_the_contiguous_cache_exactly(model, tokens, positions):
    sinks, window = 4, N
    cache = WindowKVCache.for_model(model, B, window=window, sinks=sinks, positions=positions)
    contiguous = ContiguousKVCache.for_model(model, B, sinks + window)
    # Nothing is evicted, so the window cache takes its plain paths: the same kernel calls as the contiguous cache,
    # on stores of the same capacity (the same strides), with the same data. Equal bit for bit.
    assert_close(run(model, cache, tokens), run(model, contiguous, tokens), rtol=0, atol=0)


# -- (d) per-layer windows == per-layer masked full cache ---------------------------------------------------------
@pytest.mark.parametrize(("windows", "sinks"), [((4, None), 1), ((None, 3), 0)])
def test_per_layer_windows_equal_a_per_layer_masked_full_cache(model, tokens, windows, sinks):
    cache = WindowKVCache.for_model(model, B, N, window=windows, sinks=sinks)
    got = run(model, cache, tokens)
    assert_close(got, run(model, windowed_reference(model, sinks, windows), tokens), **TOL)
    assert [cache.held(layer) for layer in range(CFG.n_layers)] == [N if w is None else sinks + w for w in windows]


# -- (e) a model with sliding-window layers: no cache reads past the layer's window --------------------------------
def test_the_models_own_window_cache_equals_the_uncached_model(windowed, tokens):
    cache = windowed.new_cache(B, N)
    assert isinstance(cache, WindowKVCache) and cache.windows == [4, None] and cache.sinks == 0
    with torch.no_grad():
        want = windowed(tokens)
    assert_close(run(windowed, cache, tokens), want, **TOL)
    assert [cache.held(layer) for layer in range(2)] == [4, N]
    per_token = 2 * 2 * 16 * 4  # K and V x 2 KV heads x head dim 16 x fp32, one layer
    assert cache.bytes_read_per_step() == B * (4 + N) * per_token
    assert cache.bytes_read_per_step(3) == B * (3 + 3) * per_token
    # The window matters: the same model without it gives other logits.
    with torch.no_grad():
        assert (peaked(CFG)(tokens) - want).abs().max() > 1e-2


@pytest.mark.parametrize(
    "make",
    [
        # Keeps more than layer 0's window, and sinks older than it: both masked by position.
        lambda m: WindowKVCache.for_model(m, B, N, window=(8, None), sinks=2),
        lambda m: WindowKVCache.for_model(m, B, N, window=(8, None), sinks=2, positions="reassigned"),
        # Keeps every token of every layer (a plain window longer than the sequence): the slab reads the window.
        lambda m: WindowKVCache.for_model(m, B, window=N),
        # H2O with room for every token: nothing evicted, everything past the window masked.
        lambda m: HeavyHitterKVCache.for_model(m, B, heavy=N, recent=1),
    ],
    ids=["longer-window+sinks", "reassigned", "global", "h2o-roomy"],
)
def test_a_cache_keeping_more_than_the_layers_window_masks_it(windowed, tokens, make):
    with torch.no_grad():
        want = windowed(tokens)
    assert_close(run(windowed, make(windowed), tokens), want, **TOL)


@pytest.mark.parametrize(("windows", "sinks"), [((6, 6), 1), ((2, None), 0)])
def test_a_policy_on_a_windowed_model_equals_both_masks(windowed, tokens, windows, sinks):
    """The policy's own window on top of the model's: a query sees what both allow."""
    cache = WindowKVCache.for_model(windowed, B, N, window=windows, sinks=sinks)
    want = run(windowed, windowed_reference(windowed, sinks, windows), tokens)
    assert_close(run(windowed, cache, tokens), want, **TOL)


# -- (f) heavy hitters == brute-force H2O oracle ------------------------------------------------------------------
class H2OOracle(MaskedFullCache):
    """A full cache plus H2O written out: Python sets of kept positions per (layer, sequence, KV head), scores
    summed from the reference attention's probabilities, decisions by sorting.

    ``margins`` records, for every decision made on scores, how far the chosen token's score is from the next
    candidate's: the cache's scores differ from these by rounding, so its choices must match only where the
    margins exceed that difference.
    """

    def __init__(self, model: Decoder, heavy: int, recent: int) -> None:
        super().__init__(model, lambda layer, b, h, p, a: a in self.kept[layer][b][h])
        cfg = model.cfg
        self.heavy, self.recent = heavy, recent
        self.kept = [[[set() for _ in range(cfg.n_kv_heads)] for _ in range(B)] for _ in range(cfg.n_layers)]
        self.scores = torch.zeros(cfg.n_layers, B, cfg.n_kv_heads, N)
        self.margins: list[float] = []

    def attend(self, layer: int, q: torch.Tensor, layer_window=None, rotate=None) -> torch.Tensor:
        t, end = q.shape[-2], self.length
        budget = self.heavy + self.recent
        for b in range(B):
            for h in range(self.n_kv_heads):
                kept, score = self.kept[layer][b][h], self.scores[layer, b, h].tolist()
                if t == 1 and len(kept) == budget:  # make room: the lowest score outside the recent-1 newest
                    lowest = sorted((a for a in kept if a <= end - 1 - self.recent), key=score.__getitem__)
                    self.margins += [score[lowest[1]] - score[lowest[0]]] if len(lowest) > 1 else []
                    kept.remove(lowest[0])
                kept.update(range(end - t, end))
        out = super().attend(layer, q, layer_window)
        if t > 1:
            for b in range(B):
                for h in range(self.n_kv_heads):
                    kept, score = self.kept[layer][b][h], self.scores[layer, b, h].tolist()
                    ranked = sorted(kept, key=lambda a: (a >= end - self.recent, score[a]), reverse=True)
                    if len(ranked) > budget and ranked[budget - 1] < end - self.recent:  # the cut is by score
                        self.margins.append(score[ranked[budget - 1]] - score[ranked[budget]])
                    self.kept[layer][b][h] = set(ranked[:budget])
        return out

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        b, _, t, n = probs.shape
        self.scores[layer, :, :, :n] += probs.view(b, self.n_kv_heads, -1, t, n).sum(dim=(2, 3))


def check_h2o_against_the_oracle(model, tokens, heavy, recent, schedule):
    cache, oracle = HeavyHitterKVCache.for_model(model, B, heavy=heavy, recent=recent), H2OOracle(model, heavy, recent)
    got, want, start = [], [], 0
    for n in schedule:  # in lockstep, so the kept sets are compared after every step
        got.append(run(model, cache, tokens[:, start : start + n], [n]))
        want.append(run(model, oracle, tokens[:, start : start + n], [n]))
        start += n
        for layer in range(model.cfg.n_layers):
            positions = cache.kept_positions(layer)
            for b in range(B):
                for h in range(model.cfg.n_kv_heads):
                    assert set(positions[b, h].tolist()) == oracle.kept[layer][b][h], (start, layer, b, h)
    assert_close(torch.cat(got, dim=1), torch.cat(want, dim=1), **TOL)
    # The cache sums probabilities from its own kernel, the oracle from the reference's: equal to rounding.
    scores = cache.attention_scores(0)
    assert_close(scores, oracle.scores[0].gather(-1, cache.kept_positions(0)), **TOL)
    # The kept sets above were compared exactly; that holds on any CPU only if no decision hinged on a difference
    # the size of that rounding (two scores, each within TOL of the oracle's).
    rounding = 2 * (TOL["atol"] + TOL["rtol"] * oracle.scores.abs().max().item())
    assert min(oracle.margins) > 10 * rounding, f"a decision is {min(oracle.margins):.3g} from a tie; {rounding=:.3g}"


@pytest.mark.parametrize(
    ("heavy", "recent", "schedule"), [(3, 4, SCHEDULE), (2, 1, [1] * N), (5, 2, [4, 12] + [1] * 24)]
)
def test_heavy_hitters_keep_the_top_scored_tokens_and_equal_the_masked_reference(
    model, tokens, heavy, recent, schedule
):
    check_h2o_against_the_oracle(model, tokens, heavy, recent, schedule)


def test_heavy_hitters_on_a_windowed_model_equal_the_oracle_with_the_window(windowed, tokens):
    """Tokens past layer 0's window are masked: they draw no attention there, so they gain no score."""
    check_h2o_against_the_oracle(windowed, tokens, 2, 2, SCHEDULE)  # heavy 2 + recent 2 = layer 0's window


def test_heavy_hitters_decide_per_kv_head():
    """Head 0's query matches token 1's key and head 1's matches token 2's: each head keeps its own heavy hitter."""
    cache = HeavyHitterKVCache(CacheShape(n_layers=1, n_kv_heads=2, head_dim=4), heavy=1, recent=2)
    e = 3.0 * torch.eye(4)
    keys = [torch.zeros(4), e[0], e[1], torch.zeros(4)]
    q = torch.stack((e[0], e[1]))[None, :, None, None] * 2.0 * 4**-0.5  # [B, Hkv, G, T, D], scaled: logits of 9
    for k in keys:
        cache.reserve(1)
        cache.append(0, k.expand(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
        cache.attend(0, q)
    # Scores before the last step: head 0 {0: ~1, 1: ~2, 2: ~0}, head 1 {0: ~1.5, 1: ~0.5, 2: ~1}; token 2 is
    # recent, so head 0 evicts token 0 and head 1 evicts token 1.
    assert [sorted(cache.kept_positions(0)[0, h].tolist()) for h in range(2)] == [[1, 2, 3], [0, 2, 3]]


def test_heavy_hitters_without_heavy_slots_is_a_sliding_window(model, tokens):
    h2o = HeavyHitterKVCache.for_model(model, B, heavy=0, recent=5)
    window = WindowKVCache.for_model(model, B, window=5)
    assert_close(run(model, h2o, tokens, [1] * N), run(model, window, tokens, [1] * N), **TOL)


def test_heavy_hitters_fast_fill_then_decode(model):
    cache = HeavyHitterKVCache.for_model(model, B, heavy=3, recent=4)
    cache.fast_fill(30, generator=torch.Generator().manual_seed(0), chunk=8)
    model.decode_step(torch.zeros(B, dtype=torch.long), cache)
    positions = cache.kept_positions(0)
    assert positions.shape == (B, CFG.n_kv_heads, 7) and cache.length == 7
    assert set(range(27, 31)) <= set(positions[0, 0].tolist())


# -- bytes, against hand counts -----------------------------------------------------------------------------------
def test_window_bytes_match_a_hand_count(model, tokens):
    cache = WindowKVCache.for_model(model, B, window=6, sinks=2)
    allocated = cache.bytes_allocated()
    run(model, cache, tokens)
    per_token = 2 * 2 * 16 * 4  # K and V x 2 KV heads x head dim 16 x fp32, one layer
    assert cache.bytes_stored() == B * 2 * (2 + 6) * per_token  # sinks + window per layer, not 40 tokens
    assert cache.bytes_read_per_step() == B * 2 * 8 * per_token
    assert cache.bytes_read_per_step(5) == B * 2 * 5 * per_token  # before the window fills, all of the context
    assert cache.bytes_read_per_step(100_000) == B * 2 * 8 * per_token
    assert cache.bytes_written_per_step() == B * 2 * per_token
    assert cache.bytes_allocated() == allocated == B * 2 * 8 * per_token  # bounded, and never grew


def test_per_layer_window_bytes_match_a_hand_count(model, tokens):
    cache = WindowKVCache.for_model(model, B, 64, window=(4, None), sinks=1, codec="fp16")
    run(model, cache, tokens)
    per_token = 2 * 2 * 16 * 2  # fp16
    assert cache.bytes_stored() == B * (1 + 4 + N) * per_token  # the local layer holds 5, the global one all 40
    assert cache.bytes_read_per_step(1000) == B * (5 + 1000) * per_token
    assert cache.bytes_read_per_step(3) == B * (3 + 3) * per_token
    assert cache.bytes_written_per_step() == B * 2 * per_token
    assert cache.bytes_allocated() == B * (5 + 64) * per_token


def test_heavy_hitter_bytes_match_a_hand_count(model, tokens):
    cache = HeavyHitterKVCache.for_model(model, B, heavy=3, recent=4)
    run(model, cache, tokens)
    kv, layers, heads, budget = 2 * 2 * 16 * 4, 2, 2, 7  # kv: one token's K and V in one layer
    score, position = 4, 8  # fp32 score and int64 position per kept slot and KV head
    assert cache.bytes_stored() == B * layers * budget * (kv + heads * (score + position))
    # A full step: K/V of the budget; the budget's scores read to add to; every slot's score and position read
    # to choose the evicted one.
    kept_read = B * layers * heads * budget * score
    evict_read = B * layers * heads * budget * (score + position)
    assert cache.score_bytes_read_per_step() == kept_read + evict_read
    assert cache.bytes_read_per_step() == B * layers * budget * kv + kept_read + evict_read
    assert cache.bytes_read_per_step(5) == B * layers * 5 * (kv + heads * score)  # not full: no eviction
    # Writes: the new token's K/V, its score and position, and the budget's updated scores.
    written = B * layers * (kv + heads * (score + position) + heads * budget * score)
    assert cache.bytes_written_per_step() == written
    assert cache.bytes_allocated() == B * layers * budget * (kv + heads * (score + position))


# -- capacity and arguments ---------------------------------------------------------------------------------------
def test_a_global_layer_is_bounded_by_capacity_and_a_full_cache_changes_nothing(model):
    cache = WindowKVCache.for_model(model, 1, 8, window=(2, None))
    cache.fast_fill(6)
    with pytest.raises(CacheCapacityError):
        cache.reserve(3)
    assert cache.n_seen == 6 and cache.length == 6
    every_layer_local = WindowKVCache.for_model(model, 1, window=2, sinks=1)
    every_layer_local.fast_fill(1000, chunk=64)
    assert every_layer_local.capacity is None and every_layer_local.length == 3


SHAPE = CacheShape(n_layers=2, n_kv_heads=2, head_dim=16)


def _window(shape=SHAPE, **kwargs):
    return WindowKVCache(shape, **(dict(window=4) | kwargs))


def _h2o(shape=SHAPE, **kwargs):
    return HeavyHitterKVCache(shape, **(dict(heavy=2, recent=2) | kwargs))


LATENT = CacheShape(n_layers=2, n_kv_heads=1, head_dim=40, latent_values=32)


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (_window, dict(window=0), r"window: 0 .*allowed: an integer >= 1"),
        (_window, dict(window=(4,)), r"window: .*allowed: .*2 entries"),
        (_window, dict(window=(4, "8")), r"window\[1\]: '8' .*allowed: an integer >= 1"),
        (_window, dict(window=True), r"window: True .*allowed"),
        (_window, dict(sinks=-1), r"sinks: -1 .*allowed: an integer >= 0"),
        (_window, dict(positions="relative"), r"positions: 'relative' .*allowed: 'original', 'reassigned'"),
        (_window, dict(window=(4, None)), r"capacity: None .*allowed: an integer >= 1"),
        (_window, dict(capacity=0), r"capacity: 0 .*allowed: an integer >= 1"),
        (_window, dict(codec="int3"), r"codec: .*'int3'.*allowed: .*int8"),
        (_window, dict(batch_size=0), r"batch_size: 0 .*allowed: an integer >= 1"),
        (_window, dict(shape=LATENT, positions="reassigned"), r"positions: 'reassigned' with an MLA latent"),
        (_h2o, dict(heavy=-1), r"heavy: -1 .*allowed: an integer >= 0"),
        (_h2o, dict(recent=0), r"recent: 0 .*allowed: an integer >= 1"),
        (_h2o, dict(shape=LATENT), r"shape: an MLA latent .*allowed: per-head K/V"),
        (_h2o, dict(shape=(2, 2, 16)), r"shape: tuple; allowed: a kvlab.cache.CacheShape"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_allowed_values(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_bad_step_arguments_raise(model):
    cache = WindowKVCache.for_model(model, 1, window=4)
    with pytest.raises(ValueError, match=r"n_new: 0 .*allowed: an integer >= 1"):
        cache.reserve(0)
    with pytest.raises(ValueError, match=r"context: -1 .*allowed: an integer >= 0"):
        cache.bytes_read_per_step(-1)
    # Re-assigned positions past the first eviction need the attention module's rotate.
    reassigned = WindowKVCache(SHAPE, window=2, sinks=1, positions="reassigned")
    reassigned.fast_fill(5)
    reassigned.reserve(1)
    reassigned.append(0, torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 2, 16))
    with pytest.raises(ValueError, match=r"rotate: None .*allowed: the attention module's rotate"):
        reassigned.attend(0, torch.zeros(1, 2, 2, 1, 16))
    mla = MLAConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    latent = SimpleNamespace(cfg=ModelConfig(n_layers=2, d_model=64, n_heads=4, mla=mla), device="cpu")
    with pytest.raises(ValueError, match=r"shape: an MLA latent .*allowed: per-head K/V"):
        HeavyHitterKVCache.for_model(latent, heavy=1, recent=1)


def test_a_window_cache_without_a_window_names_the_field(model):
    with pytest.raises(ValueError, match=r"window: None is not allowed; allowed: an integer >= 1.*layer_windows"):
        WindowKVCache.for_model(model, 1, 16)
