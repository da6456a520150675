"""The continuous-batching engine: batching, chunked prefill, preemption and prefix hits change no request's tokens,
every block comes back, bad requests fail alone, and the simulated clock's latencies follow its byte model."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.cache.storage.paged import PagedKVCache
from kvlab.engine import Engine
from kvlab.engine.clock import SimulatedClock
from kvlab.engine.request import Request, RunReport
from kvlab.engine.scheduler import ModelCall
from kvlab.model.decoder import Decoder
from kvlab.roofline import active_params, kv_bytes_per_step, kv_bytes_per_token, weight_bytes_read

from .helpers import assert_greedy_picks, tiny_config

# A request's tokens come from chunked prefills and ragged paged decodes; the reference, from one prefill and
# contiguous decodes: the same arithmetic blocked differently, logits (|x| < 1) a few fp32 ulps apart.
LOGIT_TOL = dict(rtol=1e-5, atol=1e-5)
# In bf16 (cuda, cpu-bf16) each stored activation is rounded to 2^-9 of itself: the two blockings part by a few bf16
# ulps on logits near 1. A wrong position or block moves a logit by 0.1 or more.
BF16_LOGIT_TOL = dict(rtol=0, atol=3e-2)
CFG = tiny_config()
BANDWIDTH_GBPS = 1.0  # simulated: the tiny model's ~0.3 MB of weights take ~0.3 ms per call


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder(CFG)


@cache
def generate_alone(prompt: tuple[int, ...], n: int) -> list[int]:
    return Decoder(CFG).generate(list(prompt), n).tolist()


def assert_as_alone(model: Decoder, request: Request, output: list[int], tol: dict = LOGIT_TOL) -> None:
    """``output`` is what ``model.generate`` gives the request alone, up to greedy ties within rounding: where the
    two differ, each output token must still be a greedy pick of the logits of its own prefix (``model``'s, on its
    device and in its dtype; the reference alone is fp32)."""
    if output == generate_alone(request.prompt_ids, request.max_new_tokens):
        return
    assert len(output) == request.max_new_tokens
    n_prompt = len(request.prompt_ids)
    with torch.no_grad():
        logits = model(torch.tensor([[*request.prompt_ids, *output]]))[0, n_prompt - 1 : n_prompt - 1 + len(output)]
    assert_greedy_picks(torch.tensor(output), logits.float().cpu(), **tol)


def check_run(engine: Engine, model: Decoder, requests: list[Request], tol: dict = LOGIT_TOL) -> RunReport:
    report = engine.run(requests)
    assert len(report.results) == len(requests)
    for request, result in zip(requests, report.results, strict=True):
        assert result.error is None
        assert_as_alone(model, request, result.output_ids, tol)
        assert len(result.itl_ms) == request.max_new_tokens - 1
        assert 0 <= result.ttft_ms <= result.e2el_ms
    assert engine.free_blocks == engine.n_blocks
    return report


def mixed_requests(seed: int, n: int, spacing_s: float) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length, new = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 24), (1, 9)))
        out.append(Request(torch.randint(0, CFG.vocab_size, (length,), generator=gen).tolist(), new, i * spacing_s))
    return out


# -- tokens equal generate alone -----------------------------------------------------------------------------------
def test_batched_run_equals_each_request_alone(target) -> None:
    model = Decoder(tiny_config(dtype=target.dtype), device=target.device)
    tol = target.tol(LOGIT_TOL, BF16_LOGIT_TOL)
    requests = mixed_requests(0, 8, spacing_s=0.002)  # real time: later ones arrive while others decode
    engine = Engine(model, n_blocks=64, block_size=4, max_batch=4, token_budget=12)
    report = check_run(engine, model, requests, tol)
    assert report.preemptions == 0 and report.steps > 0
    assert report.output_tokens == sum(r.max_new_tokens for r in requests)
    check_run(engine, model, requests, tol)  # the engine serves a second run from the same pool


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_quantized_pool_serves_what_the_same_cache_gives_alone(model: Decoder, kv_dtype: str) -> None:
    # Codes are grouped within one token's channels, so chunking and batching do not change what is stored.
    requests = mixed_requests(1, 6, spacing_s=0.0)
    engine = Engine(model, n_blocks=64, block_size=4, max_batch=3, token_budget=8, kv_dtype=kv_dtype)
    report = engine.run(requests)
    for request, result in zip(requests, report.results, strict=True):
        cache = PagedKVCache.for_model(model, capacity=64, block_size=4, codec=kv_dtype)
        assert (
            result.output_ids == model.generate(list(request.prompt_ids), request.max_new_tokens, cache=cache).tolist()
        )
    assert engine.cache.codec == kv_dtype and engine.free_blocks == engine.n_blocks
    charged = Engine(model, n_blocks=8, kv_dtype="int8", clock="simulated", bandwidth_gbps=1.0).clock
    assert charged.kv_bytes_per_token == kv_bytes_per_token(CFG, "int8")


def test_a_windowed_pool_serves_what_the_window_gives_alone_and_frees_blocks(model: Decoder) -> None:
    # Long outputs past a window of 8 + 2 sinks: each request's tokens are those the same policy gives it alone,
    # and a request never holds more than its sinks' and window's blocks (plus the one being filled).
    gen = torch.Generator().manual_seed(5)
    requests = [Request(torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist(), 24) for n in (3, 12, 7)]
    engine = Engine(model, n_blocks=64, block_size=4, max_batch=3, token_budget=8, window=8, sinks=2)
    report = engine.run(requests)
    for request, result in zip(requests, report.results, strict=True):
        cache = PagedKVCache.for_model(model, capacity=64, block_size=4, window=8, sinks=2)
        alone = model.generate(list(request.prompt_ids), request.max_new_tokens, cache=cache).tolist()
        assert result.output_ids == alone
    assert report.peak_blocks <= 3 * (1 + 2 + 2) + 3  # per request: 1 sink block, 2 window blocks, 1 filling
    assert engine.free_blocks == engine.n_blocks
    clock = Engine(model, n_blocks=8, window=8, sinks=2, clock="simulated", bandwidth_gbps=1.0).clock
    assert (clock.window, clock.sinks) == (8, 2)


def test_preemption_by_recompute_keeps_the_tokens(target) -> None:
    model = Decoder(tiny_config(dtype=target.dtype), device=target.device)
    # 8 blocks of 4 hold 32 tokens; four requests of up to 23 + 8 tokens cannot all grow at once.
    requests = mixed_requests(1, 6, spacing_s=0.0)
    engine = Engine(model, n_blocks=8, block_size=4, max_batch=4, clock="simulated", bandwidth_gbps=BANDWIDTH_GBPS)
    report = check_run(engine, model, requests, target.tol(LOGIT_TOL, BF16_LOGIT_TOL))
    assert report.preemptions > 0
    assert report.preemptions == sum(r.preemptions for r in report.results)


def test_prefix_hits_keep_the_tokens(model: Decoder) -> None:
    shared = list(range(50, 62))  # 12 tokens: three full blocks of 4
    requests = [Request([*shared, 90 + i], 5) for i in range(3)]
    engine = Engine(model, n_blocks=32, block_size=4, max_batch=1, clock="simulated", bandwidth_gbps=BANDWIDTH_GBPS)
    report = check_run(engine, model, requests)
    # One at a time: the first finds nothing; each later one finds the three shared blocks (its fourth block holds
    # its own last token).
    assert report.prefix_hit_tokens == 2 * 3 * 4
    off = Engine(model, n_blocks=32, block_size=4, max_batch=1, prefix_caching=False, clock="simulated",
                 bandwidth_gbps=BANDWIDTH_GBPS)  # fmt: skip
    assert check_run(off, model, requests).prefix_hit_tokens == 0


def test_peak_batch_and_blocks_follow_admission(model: Decoder) -> None:
    # Six requests of 7 prompt + 2 new tokens at once: each needs ceil((7 + 1) / 4) = 2 blocks to be admitted and
    # holds 2 blocks to the end (its 8 cached tokens fill two blocks exactly). 7 blocks admit 3 (3 x 2 = 6 <= 7 <
    # 8), so at most 3 run and 6 blocks are held; random prompts share no block.
    gen = torch.Generator().manual_seed(3)
    requests = [Request(torch.randint(0, CFG.vocab_size, (7,), generator=gen).tolist(), 2) for _ in range(6)]
    engine = Engine(model, n_blocks=7, block_size=4, max_batch=8, clock="simulated", bandwidth_gbps=BANDWIDTH_GBPS)
    report = check_run(engine, model, requests)
    assert (report.max_running, report.peak_blocks, report.preemptions) == (3, 6, 0)
    engine.max_batch = 2
    assert (engine.run(requests).max_running, engine.run(requests[:1]).max_running) == (2, 1)


def trace_strategy() -> st.SearchStrategy:
    base = list(range(3, 40))  # prompts draw a prefix of it, so some share blocks
    request = st.builds(
        lambda shared, own, new, tick: Request(base[:shared] + own, new, tick * 5e-4),
        st.integers(0, 12),
        st.lists(st.integers(0, CFG.vocab_size - 1), min_size=1, max_size=8),
        st.integers(1, 6),
        st.integers(0, 10),
    )
    return st.lists(request, min_size=1, max_size=5)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    requests=trace_strategy(),
    n_blocks=st.integers(6, 20),  # 6 blocks of 4 hold the longest request (12 + 8 + 6 - 1 = 25 tokens) alone
    max_batch=st.integers(1, 4),
    token_budget=st.integers(1, 16),
)
def test_random_traces_equal_each_request_alone(
    model: Decoder, requests: list[Request], n_blocks: int, max_batch: int, token_budget: int
) -> None:
    engine = Engine(model, n_blocks=n_blocks, block_size=4, max_batch=max_batch, token_budget=token_budget,
                    clock="simulated", bandwidth_gbps=BANDWIDTH_GBPS)  # fmt: skip
    check_run(engine, model, requests)


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prompt_ids=[], max_new_tokens=2), "prompt_ids"),
        (dict(prompt_ids=[1, -3], max_new_tokens=2), "prompt_ids"),
        (dict(prompt_ids=[1, 2.5], max_new_tokens=2), "prompt_ids"),
        (dict(prompt_ids="abc", max_new_tokens=2), "prompt_ids"),
        (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt_ids=[1], max_new_tokens=2, arrival_s=-1.0), "arrival_s"),
        (dict(prompt_ids=[1], max_new_tokens=2, arrival_s=math.nan), "arrival_s"),
    ],
)
def test_request_refuses_bad_fields(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Request(**kwargs)


def test_a_bad_request_fails_alone(model: Decoder) -> None:
    good = mixed_requests(2, 3, spacing_s=0.0)
    out_of_vocab = Request([5, CFG.vocab_size], 3)
    too_long = Request(list(range(30)), 11)  # 30 + 11 - 1 = 40 cached tokens; the pool holds 10 x 4 = 40
    too_long_by_one = Request(list(range(30)), 12)
    requests = [good[0], out_of_vocab, good[1], too_long_by_one, good[2], too_long]
    engine = Engine(model, n_blocks=10, block_size=4, clock="simulated", bandwidth_gbps=BANDWIDTH_GBPS)
    report = engine.run(requests)
    bad = {1: f"vocab_size={CFG.vocab_size}", 3: "n_blocks x block_size = 10 x 4 = 40"}
    for i, (request, result) in enumerate(zip(requests, report.results, strict=True)):
        if i in bad:
            assert result.output_ids == [] and result.ttft_ms is None and result.itl_ms == []
            assert "prompt_ids" in result.error and bad[i] in result.error
        else:
            assert result.error is None
            assert_as_alone(model, request, result.output_ids)
    assert len(report.completed) == 4 and engine.free_blocks == engine.n_blocks


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(clock="simulated"), "bandwidth_gbps"),
        (dict(clock="real", gpu="h100-sxm"), "gpu"),
        (dict(clock="sundial"), "clock"),
        (dict(clock="simulated", gpu="no-such-gpu"), "gpu"),
        (dict(max_batch=0), "max_batch"),
        (dict(token_budget=0), "token_budget"),
        (dict(prefix_caching="yes"), "prefix_caching"),
    ],
)
def test_engine_refuses_bad_options(model: Decoder, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Engine(model, n_blocks=8, **kwargs)


def test_run_refuses_what_is_not_a_request(model: Decoder) -> None:
    with pytest.raises(ValueError, match="requests"):
        Engine(model, n_blocks=8).run([([1, 2], 3)])


# -- metrics -------------------------------------------------------------------------------------------------------
def test_simulated_latencies_follow_the_byte_model(model: Decoder) -> None:
    # fp32 K and V for 2 layers x 2 KV heads x 16 dims: 2 x 2 x 2 x 16 x 4 = 512 bytes per token.
    kv = 2 * 2 * 2 * 16 * 4
    seconds = lambda n_bytes: n_bytes / (BANDWIDTH_GBPS * 1e9)  # noqa: E731
    prefill = seconds(weight_bytes_read(CFG, batch=5) + kv * (0 + 2 * 5))  # 5 prompt tokens: read 5, write 5
    decode = [seconds(weight_bytes_read(CFG, batch=1) + kv * (c + 2)) for c in (5, 6)]  # over 5, then 6 cached
    # The second arrives after the first is done: the engine idles to 1 s, and its latencies count from there.
    requests = [Request([1, 2, 3, 4, 5], 3), Request([6, 7, 8, 9, 10], 3, arrival_s=1.0)]
    engine = Engine(model, n_blocks=8, block_size=4, clock="simulated", bandwidth_gbps=BANDWIDTH_GBPS)
    report = engine.run(requests)
    for result in report.results:
        assert result.ttft_ms == pytest.approx(prefill * 1e3, rel=1e-12)
        assert result.itl_ms == pytest.approx([d * 1e3 for d in decode], rel=1e-9)
        assert result.tpot_ms == pytest.approx(sum(decode) / 2 * 1e3, rel=1e-9)
        assert result.e2el_ms == pytest.approx((prefill + sum(decode)) * 1e3, rel=1e-9)
    total = 1.0 + prefill + sum(decode)
    assert report.duration_s == pytest.approx(total, rel=1e-12)
    assert report.output_tokens_per_s == pytest.approx(6 / total, rel=1e-12)
    assert report.requests_per_s == pytest.approx(2 / total, rel=1e-12)
    tpot_ms = sum(decode) / 2 * 1e3
    assert report.goodput(ttft_ms=1e3, tpot_ms=tpot_ms * 1.01) == pytest.approx(2 / total, rel=1e-12)
    assert report.goodput(ttft_ms=1e3, tpot_ms=tpot_ms * 0.99) == 0
    assert report.metrics()["p99_tpot_ms"] == pytest.approx(tpot_ms, rel=1e-9)


def test_simulated_clock_reads_only_what_a_window_keeps() -> None:
    # A decode row over 1,000 cached tokens: a window of 100 + 4 sinks reads 104 of them per layer, int8 codes
    # shrink each; the model's own local layers read their window. The token written is charged in full either way.
    call = ModelCall(((1, 1000),))
    full = SimulatedClock(CFG, 1.0)
    per_token = kv_bytes_per_token(CFG)
    assert full.call_bytes(call) == weight_bytes_read(CFG, batch=1) + per_token * 1001 + per_token
    windowed = SimulatedClock(CFG, 1.0, window=100, sinks=4)
    assert windowed.call_bytes(call) == weight_bytes_read(CFG, batch=1) + per_token * 104 + per_token
    int8 = SimulatedClock(CFG, 1.0, kv_dtype="int8", window=100, sinks=4)
    assert int8.call_bytes(call) - weight_bytes_read(CFG, batch=1) == kv_bytes_per_step(
        CFG, 1001, 1, "int8", 100, 4
    ) + kv_bytes_per_token(CFG, "int8")
    local = CFG.replace(layer_windows=(16,) + (None,) * (CFG.n_layers - 1))
    assert (
        SimulatedClock(local, 1.0).call_bytes(call)
        == weight_bytes_read(local, batch=1) + kv_bytes_per_step(local, 1001) + per_token
    )
    assert kv_bytes_per_step(local, 1001) < per_token * 1001
    with pytest.raises(ValueError, match="sinks"):
        SimulatedClock(CFG, 1.0, sinks=4)


def test_simulated_clock_charges_flops_where_they_bind() -> None:
    # A 1,000-token prefill chunk over nothing cached: 2 FLOPs per parameter per token plus attention's 4 x layers
    # x heads x head_dim per (query, key) pair, 1000 x 1001 / 2 pairs (causal).
    clock = SimulatedClock(CFG, bandwidth_gbps=1.0, peak_flops_per_s=1e9)
    call = ModelCall(((1000, 0),))
    flops = 2 * active_params(CFG) * 1000 + 4 * CFG.n_layers * CFG.n_heads * CFG.head_dim * (1000 * 1001 // 2)
    assert clock.call_flops(call) == flops
    assert clock.call_seconds(call) == pytest.approx(max(flops / 1e9, clock.call_bytes(call) / 1e9), rel=1e-12)
    h100 = SimulatedClock.for_gpu(CFG, "h100-sxm")
    assert h100.bandwidth_gbps > 1000 and h100.peak_flops_per_s > 1e14
