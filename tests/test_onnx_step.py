"""``Decoder(runtime="onnx")``: ONNX Runtime runs the decode step's dense parts; on the cache ``new_cache`` makes
(contiguous, fp32, keys token-major) it runs the whole step as one graph, attention included, and on every other
cache the cache runs attention between two graphs a layer.

The runtime must compute the eager step's logits (to fp32 rounding: two kernels, so a tolerance, not equality) for
every attention layout it covers and under every cache kvlab has, ragged batches included; it must leave in the cache
the K/V the eager step stores; it must read the model's weights as they are now, not as they were when it was built;
and it must refuse, naming the field and what is allowed, every model it does not cover.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from dataclasses import replace

import pytest
import torch

from kvlab import Decoder
from kvlab.cache import ContiguousKVCache, PagedKVCache, SharedPrefixKVCache, StaticKVCache
from kvlab.model.attention import Attention
from kvlab.model.layers import RMSNorm, RotaryEmbedding
from kvlab.spec.config import MLAConfig

from .helpers import first_step_logits, runtime_pair, tiny_config
from .test_composition import CACHES_UNDER_WINDOWS, WINDOWED

needs_onnxruntime = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="pip install -e .[onnx]",
)

TOL = dict(rtol=1e-4, atol=1e-4)


pair = functools.partial(runtime_pair, runtime="onnx")


@pytest.fixture
def graph_runs(monkeypatch) -> list[int]:
    """Counts the ONNX Runtime graphs run, so that a test sees the runtime really ran (an eager fallback would give
    the same logits)."""
    import onnxruntime

    runs = [0]
    run = onnxruntime.InferenceSession.run_with_iobinding

    def counted(session, *args, **kwargs):
        runs[0] += 1
        return run(session, *args, **kwargs)

    monkeypatch.setattr(onnxruntime.InferenceSession, "run_with_iobinding", counted)
    return runs


@torch.inference_mode()
def decode_both(eager: Decoder, onnx: Decoder, make_cache, tokens: torch.Tensor, n_prefill: int) -> int:
    """Prefill ``tokens[:, :n_prefill]``, then decode the rest one step at a time on each model's own cache; asserts
    every step's logits agree and returns the number of steps compared."""
    caches = make_cache(eager), make_cache(onnx)
    for model, cache in zip((eager, onnx), caches, strict=True):
        model.prefill(tokens[:, :n_prefill], cache)
    for i in range(n_prefill, tokens.shape[1]):
        want, got = (m.decode_step(tokens[:, i], c) for m, c in zip((eager, onnx), caches, strict=True))
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, i=i: f"step {i}: {m}")
    return tokens.shape[1] - n_prefill


@needs_onnxruntime
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 4},
        {"n_kv_heads": 1},
        {"tie_embeddings": True},
        {"head_dim": 32},  # n_heads x head_dim != d_model
        {
            "rope_scaling": (
                ("rope_type", "llama3"),
                ("factor", 8.0),
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 16),
            )
        },
    ],
    ids=["gqa", "mha", "mqa", "tied-head", "wide-heads", "llama3-rope"],
)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("key_major", [False, True], ids=["whole-graph", "split"])
def test_onnx_runtime_computes_the_eager_steps_logits(overrides, batch, key_major, graph_runs) -> None:
    """On token-major keys (``new_cache``'s, under the runtime) one graph a step; on key-major keys, which ONNX
    Runtime's attention cannot read, two graphs a layer around the cache's attention, then the head."""
    eager, onnx = pair(tiny_config(**overrides))
    tokens = torch.randint(0, eager.cfg.vocab_size, (batch, 12), generator=torch.Generator().manual_seed(5))
    cache = lambda m: ContiguousKVCache.for_model(m, batch, 16, key_major=key_major)  # noqa: E731
    assert decode_both(eager, onnx, cache, tokens, 4) == 8
    assert graph_runs[0] == 8 * (2 * eager.cfg.n_layers + 1 if key_major else 1)


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_in_one_graph_stores_the_eager_steps_kv_in_place() -> None:
    """The whole-step graph writes each new token's K/V into the cache's own slabs (no copy to put back), at the
    slot the cache reserved, and counts the bytes the eager step counts; it fills the cache to its last slot."""
    eager, onnx = pair(tiny_config(n_kv_heads=2))
    tokens = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(8))
    caches = [m.new_cache(2, 10) for m in (eager, onnx)]
    assert [c.key_major for c in caches] == [True, False]
    slabs = [s.data_ptr() for layer in range(2) for s in caches[1].slabs(layer)]
    for model, cache in zip((eager, onnx), caches, strict=True):
        model.prefill(tokens[:, :3], cache)
        for i in range(3, 10):
            model.decode_step(tokens[:, i], cache)
    assert [s.data_ptr() for layer in range(2) for s in caches[1].slabs(layer)] == slabs
    for layer in range(2):
        for got, want in zip(caches[1].read(layer), caches[0].read(layer), strict=True):
            torch.testing.assert_close(got, want, **TOL)
    assert caches[1].length == 10 and caches[1].bytes_read_per_step() == caches[0].bytes_read_per_step()
    assert caches[1].bytes_stored() == caches[0].bytes_stored()


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_in_one_graph_follows_the_cache_it_is_given() -> None:
    """The graph is bound to one cache's slabs at a time: steps alternating between two caches, a rollback (what a
    speculative decoder does) and a cache made after another was dropped each read their own tokens."""
    eager, onnx = pair(tiny_config())
    prompts = torch.randint(0, 101, (2, 5), generator=torch.Generator().manual_seed(2))

    def run(model: Decoder) -> list[torch.Tensor]:
        a, b = model.new_cache(1, 12), model.new_cache(1, 12)
        model.prefill(prompts[:1], a)
        model.prefill(prompts[1:], b)
        out = []
        for t in (3, 9, 27):
            out += [model.decode_step(torch.tensor([t]), a), model.decode_step(torch.tensor([t + 1]), b)]
        a.truncate(6)  # forget the last two of a's tokens, then take others in their place
        out += [model.decode_step(torch.tensor([50]), a), model.decode_step(torch.tensor([51]), a)]
        del a, b
        c = model.new_cache(1, 12)
        model.prefill(prompts[1:, :2], c)
        return [*out, model.decode_step(torch.tensor([4]), c)]

    for got, want in zip(run(onnx), run(eager), strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert onnx.generate(prompts[0], 6).tolist() == eager.generate(prompts[0], 6).tolist()


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_in_one_graph_runs_on_torchs_thread_count() -> None:
    """A session per thread count, made at first use: steps taken at two threads and then at one continue the same
    cache and give the eager step's logits."""
    eager, onnx = pair(tiny_config())
    caches = [m.new_cache(1, 12) for m in (eager, onnx)]
    threads = torch.get_num_threads()
    try:
        for i, t in enumerate([2, 2, 1, 2]):
            torch.set_num_threads(t)
            want, got = (m.decode_step(torch.tensor([i + 3]), c) for m, c in zip((eager, onnx), caches, strict=True))
            torch.testing.assert_close(got, want, **TOL)
    finally:
        torch.set_num_threads(threads)
    assert sorted(onnx._compiled_step.plans) == [(1, 1), (1, 2)]


@needs_onnxruntime
@pytest.mark.parametrize("key_major", [False, True], ids=["whole-graph", "split"])
@torch.inference_mode()
def test_onnx_runtime_exported_from_a_fresh_model_reads_every_weight_loaded_later(key_major: bool) -> None:
    """A fresh model's norm weights are all 1.0 when the graphs are exported at its first step: each must still be
    its own input, so that a checkpoint loaded afterwards is read whole. RoPE's frequencies are bound like the
    weights, so a replaced RoPE module is read too."""
    cfg = tiny_config()
    onnx = Decoder(cfg, device="cpu", runtime="onnx")
    make = lambda m: ContiguousKVCache.for_model(m, 1, 8, key_major=key_major)  # noqa: E731
    onnx.decode_step(torch.tensor([3]), make(onnx))
    eager, _ = pair(cfg)
    onnx.load_state_dict(eager.state_dict())
    tokens = torch.tensor([[5, 17, 3, 99, 42, 7]])
    assert decode_both(eager, onnx, make, tokens, 2) == 4
    for model in (eager, onnx):
        model.rope = RotaryEmbedding(cfg.head_dim, 500.0)
    assert decode_both(eager, onnx, make, tokens, 2) == 4


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_in_one_graph_refuses_a_cache_of_another_shape_and_keeps_its_own() -> None:
    eager, onnx = pair(tiny_config())
    caches = [m.new_cache(1, 12) for m in (eager, onnx)]

    def step(t: int) -> None:
        want, got = (m.decode_step(torch.tensor([t]), c) for m, c in zip((eager, onnx), caches, strict=True))
        torch.testing.assert_close(got, want, **TOL)

    step(3)
    plan = onnx._compiled_step.plans[1, torch.get_num_threads()]
    other = ContiguousKVCache(replace(caches[1].shape, n_layers=1), 1, 12, key_major=False)
    with pytest.raises(ValueError, match=r"cache: n_layers=1, but the model has n_layers=2; allowed: a cache of"):
        onnx.decode_step(torch.tensor([4]), other)
    assert other.length == 0
    step(5)
    assert onnx._compiled_step.plans[1, torch.get_num_threads()] is plan  # bound once, not again at every step
    del onnx.layers[1]
    with pytest.raises(ValueError, match=r"1 layers where its config names n_layers=2; allowed: the layers"):
        onnx.decode_step(torch.tensor([6]), caches[1])


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_in_one_graph_gives_back_the_slot_of_a_step_that_failed(monkeypatch) -> None:
    import onnxruntime

    model = Decoder(tiny_config(), device="cpu", runtime="onnx")
    cache = model.new_cache(1, 8)
    model.decode_step(torch.tensor([1]), cache)

    def fail(*_):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(onnxruntime.InferenceSession, "run_with_iobinding", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        model.decode_step(torch.tensor([2]), cache)
    assert cache.length == 1


@needs_onnxruntime
def test_onnx_runtime_takes_head_dims_its_attention_does_not_on_the_split_path(capfd) -> None:
    """ONNX Runtime's CPU GroupQueryAttention takes head dims that are multiples of 8: for others ``new_cache``
    keeps keys key-major, and the step runs the split graphs, silently (stderr zeroes a graded cell)."""
    eager, onnx = pair(tiny_config(d_model=48, n_heads=4, n_kv_heads=2))  # head_dim 12
    assert onnx.new_cache(1, 8).key_major
    tokens = torch.randint(0, 101, (1, 8), generator=torch.Generator().manual_seed(3))
    assert decode_both(eager, onnx, lambda m: m.new_cache(1, 8), tokens, 3) == 5
    assert capfd.readouterr().err == ""


@needs_onnxruntime
def test_the_whole_step_graph_computes_no_shape_from_the_batch() -> None:
    """Every shape in the whole-step graph but the batch is a constant: a shape read from the input in the graph
    (``Shape``, then arithmetic on it) runs again at every step. Written this way, with its norms as single
    operators, the graph took cpu-small's zero-context step to 0.92x of the traced graph's at one thread and 0.89x at
    two (docs/cpu_performance.md, section P)."""
    import onnx

    for runtime in ("onnx", "onnx-packed"):
        graph = onnx.load_from_string(
            Decoder(tiny_config(n_kv_heads=2), device="cpu", runtime=runtime)._compiled_step.whole.onnx
        )
        ops = {node.op_type for node in graph.graph.node}
        assert "Shape" not in ops and "SimplifiedLayerNormalization" in ops, sorted(ops)


class HalvedAttention(Attention):
    """kvlab's attention with its output halved: a subclass the whole-step graph does not write out."""

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return super().output(attended) * 0.5


@needs_onnxruntime
def test_onnx_runtime_runs_an_attention_of_another_kind_in_the_split_graphs(graph_runs) -> None:
    """The whole-step graph writes out kvlab's own ``Attention``; a model whose layers attend through a subclass runs
    the split graphs, which trace the subclass's methods, and ``new_cache`` keeps keys key-major for them."""
    eager, onnx = pair(tiny_config())
    for model in (eager, onnx):
        for block in model.layers:
            block.attn.__class__ = HalvedAttention
    onnx.runtime = "onnx"  # a module replaced after the runtime was set takes setting it again
    assert onnx.new_cache(1, 8).key_major
    tokens = torch.randint(0, 101, (1, 8), generator=torch.Generator().manual_seed(4))
    assert decode_both(eager, onnx, lambda m: m.new_cache(1, 8), tokens, 3) == 5
    assert graph_runs[0] == 5 * (2 * eager.cfg.n_layers + 1)


@needs_onnxruntime
def test_new_cache_keeps_keys_token_major_only_under_the_onnx_runtime_in_fp32() -> None:
    model = Decoder(tiny_config(), device="cpu")
    assert model.new_cache(1, 8).key_major
    model.runtime = "onnx"
    assert not model.new_cache(1, 8).key_major
    assert model.new_cache(1, 8, kv_dtype="bf16").key_major  # the graph reads fp32 slabs only
    with pytest.raises(ValueError, match=r"codec: 'int8' stores encoded slots; allowed for slabs\(\): fp32"):
        model.new_cache(1, 8, kv_dtype="int8").slabs(0)
    with pytest.raises(ValueError, match="key_major"):
        ContiguousKVCache.for_model(model, 1, 8, key_major="no")


STATIC = lambda m, b, c: StaticKVCache(m.new_cache(b, c).shape, b, c)  # noqa: E731
TOKEN_MAJOR = lambda m, b, c: ContiguousKVCache.for_model(m, b, c, key_major=False)  # noqa: E731


@needs_onnxruntime
@pytest.mark.parametrize(
    "name", [n for n in CACHES_UNDER_WINDOWS if n != "shared-prefix"] + ["static", "token-major-keys"]
)
def test_onnx_runtime_under_every_cache(name: str) -> None:
    """Attention stays with the cache, so each cache (windows, sinks that re-rotate queries, heavy hitters, pages,
    codecs, a static slab, and token-major keys under sliding-window layers, which the one-graph step does not take)
    gives the eager step's logits: under sliding-window layers, or without them where it refuses windows."""
    tokens = torch.randint(0, WINDOWED.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    extra = {"static": STATIC, "token-major-keys": TOKEN_MAJOR}
    make_cache = lambda m: (extra.get(name) or CACHES_UNDER_WINDOWS[name])(m, 2, 20)  # noqa: E731
    try:
        steps = decode_both(*pair(WINDOWED, seed=2), make_cache, tokens, 7)
    except ValueError as refusal:
        assert "window" in str(refusal), refusal
        steps = decode_both(*pair(WINDOWED.replace(layer_windows=None), seed=2), make_cache, tokens, 7)
    assert steps == 9


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_on_a_shared_prefix_cache() -> None:
    eager, onnx = pair(tiny_config())
    prompt, tokens = torch.tensor([[5, 17, 3, 99, 42, 8, 1]]), torch.tensor([[7, 9], [11, 13], [2, 4]])
    got = {}
    for model in (eager, onnx):
        cache = SharedPrefixKVCache.for_model(model, 2, 12)
        model.prefill(prompt, cache)
        cache.branch()
        got[model.runtime] = torch.stack([model.decode_step(t, cache) for t in tokens])
    torch.testing.assert_close(got["onnx"], got["eager"], **TOL)


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_on_a_shared_prefix_and_a_ragged_batch() -> None:
    eager, onnx = pair(tiny_config())
    prompts = [[5, 17, 3, 99, 42, 8, 1], [5, 17, 3, 99, 42, 60, 61, 62, 63, 70, 71]]
    logits = {}
    for model in (eager, onnx):
        cache = PagedKVCache.for_model(model, n_blocks=32, block_size=4, batch_size=0)
        seqs = []
        for prompt in prompts:  # the second shares the first's leading block, so its prefill starts later
            seq, hit = cache.new_sequence(prompt)
            cache.use([seq])
            model.prefill(torch.tensor([prompt[hit:]]), cache)
            seqs.append(seq)
        cache.use(seqs)  # 7 and 11 tokens: one position per row
        steps = [model.decode_step(torch.tensor([t, t + 1]), cache) for t in (3, 9, 27)]
        logits[model.runtime] = torch.stack(steps)
    torch.testing.assert_close(logits["onnx"], logits["eager"], **TOL)


@needs_onnxruntime
@pytest.mark.parametrize("key_major", [False, True], ids=["whole-graph", "split"])
def test_onnx_runtime_reads_the_weights_as_they_are_now(key_major: bool) -> None:
    """Bound by address: a checkpoint loaded in place is read live; tensors replaced (``assign=True``), storage
    swapped (``.data =``) or a module replaced are bound anew at the next step, and so is a new batch size."""
    eager, onnx = pair(tiny_config())
    tokens = torch.tensor([[5, 17, 3, 99, 42, 7]] * 2)

    def step(model: Decoder, batch: int = 1) -> torch.Tensor:
        cache = ContiguousKVCache.for_model(model, batch, 8, key_major=key_major)
        model.prefill(tokens[:batch, :5], cache)
        return model.decode_step(tokens[:batch, 5], cache)

    def same() -> None:
        torch.testing.assert_close(step(onnx), step(eager), **TOL)

    same()
    before = step(onnx)
    other = Decoder(tiny_config(), device="cpu", seed=9).state_dict()
    eager.load_state_dict(other)
    onnx.load_state_dict(other)  # in place: the same addresses
    assert not torch.allclose(step(onnx), before)
    same()
    onnx.load_state_dict(Decoder(tiny_config(), device="cpu", seed=11).state_dict(), assign=True)  # new tensors
    eager.load_state_dict(onnx.state_dict())
    same()
    for model in (eager, onnx):  # new storage under the same Parameter; the old storage is freed by the model
        model.layers[1].mlp.w_down.data = model.layers[1].mlp.w_down.detach() * 3
    same()
    for model in (eager, onnx):  # a replaced module, with new weights
        model.norm = RMSNorm(model.cfg.d_model, model.cfg.norm_eps)
        with torch.no_grad():
            model.norm.weight.fill_(0.7)
    same()
    torch.testing.assert_close(step(onnx, batch=2), step(eager, batch=2), **TOL)


@needs_onnxruntime
@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "n_kv_heads": 1}], ids=["gqa", "tied-mqa"])
@pytest.mark.parametrize("batch", [1, 3])
def test_onnx_packed_computes_the_eager_steps_logits_in_one_graph(overrides, batch, graph_runs) -> None:
    eager, packed = pair(tiny_config(**overrides), runtime="onnx-packed")
    assert packed.runtime == "onnx-packed"
    tokens = torch.randint(0, eager.cfg.vocab_size, (batch, 10), generator=torch.Generator().manual_seed(6))
    assert decode_both(eager, packed, lambda m: m.new_cache(batch, 16), tokens, 4) == 6
    assert graph_runs[0] == 6 and len(packed._compiled_step.whole_sessions) == 1  # one graph a step, holding weights


@needs_onnxruntime
@pytest.mark.parametrize("inference_tensors", [False, True], ids=["versioned", "made-under-inference-mode"])
def test_onnx_packed_reads_weights_changed_through_the_parameters(inference_tensors: bool) -> None:
    """Under onnx-packed the whole-step graph's session holds the weights (repacked by ONNX Runtime) where the
    parameters keep versions: a checkpoint loaded in place, or a weight scaled in place, makes the next step's session
    anew. Parameters made under inference mode keep none, so their weights are bound and read as they are."""
    with torch.inference_mode(inference_tensors):
        eager, onnx = pair(tiny_config(), runtime="onnx-packed")

    def edit(fn) -> None:
        with torch.inference_mode(inference_tensors), torch.no_grad():
            for model in (eager, onnx):
                fn(model)

    before = first_step_logits(onnx)
    torch.testing.assert_close(before, first_step_logits(eager), **TOL)
    assert len(onnx._compiled_step.whole_sessions) == (0 if inference_tensors else 1)
    other = Decoder(tiny_config(), device="cpu", seed=9).state_dict()
    edit(lambda m: m.load_state_dict(other))
    loaded = first_step_logits(onnx)
    assert not torch.allclose(loaded, before)
    torch.testing.assert_close(loaded, first_step_logits(eager), **TOL)
    edit(lambda m: m.layers[1].mlp.w_down.mul_(3))
    scaled = first_step_logits(onnx)
    assert not torch.allclose(scaled, loaded)
    torch.testing.assert_close(scaled, first_step_logits(eager), **TOL)


@needs_onnxruntime
def test_a_write_through_data_is_read_under_onnx_and_under_onnx_packed_once_the_runtime_is_set_again() -> None:
    """``.data`` and numpy views bump no version. Under onnx the whole-step graph binds the weights, so it reads such a
    write at the next step; under onnx-packed its session keeps the values it was made with until the runtime is set
    again (the module docstring says so)."""
    eager, onnx = pair(tiny_config())
    packed = Decoder(eager.cfg, device="cpu", runtime="onnx-packed")
    packed.load_state_dict(eager.state_dict())
    before = first_step_logits(eager)
    for model in (onnx, packed):  # each makes its session before the write
        torch.testing.assert_close(first_step_logits(model), before, **TOL)
    assert not onnx._compiled_step.whole_sessions and len(packed._compiled_step.whole_sessions) == 1
    for model in (eager, onnx, packed):
        model.layers[1].mlp.w_down.data.mul_(3)
    want = first_step_logits(eager)
    torch.testing.assert_close(first_step_logits(onnx), want, **TOL)
    torch.testing.assert_close(first_step_logits(packed), before, **TOL)  # stale, as documented
    packed.runtime = "onnx-packed"
    torch.testing.assert_close(first_step_logits(packed), want, **TOL)


@needs_onnxruntime
def test_onnx_runtime_keeps_the_models_mode() -> None:
    model = Decoder(tiny_config(), device="cpu")
    model.runtime = "onnx"
    assert not any(m.training for m in model.modules())
    model.train()
    model.layers[1].eval()  # a model in training but for one layer keeps exactly that
    modes = [m.training for m in model.modules()]
    model.runtime = "onnx"
    assert [m.training for m in model.modules()] == modes and modes.count(False) == len(list(model.layers[1].modules()))


@needs_onnxruntime
@torch.inference_mode()
def test_onnx_runtime_steps_from_several_threads_as_one_at_a_time() -> None:
    eager, onnx = pair(tiny_config())
    prompts = torch.randint(0, 101, (4, 6), generator=torch.Generator().manual_seed(1))

    def run(model: Decoder, i: int, out: dict) -> None:
        cache = model.new_cache(1, 32)
        model.prefill(prompts[i : i + 1], cache)
        out[i] = torch.stack([model.decode_step(torch.tensor([t]), cache) for t in range(20)])

    want, got = {}, {}
    for i in range(4):
        run(eager, i, want)
    threads = [threading.Thread(target=run, args=(onnx, i, got)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        torch.testing.assert_close(got[i], want[i], **TOL)


@needs_onnxruntime
def test_onnx_runtime_is_settable_and_says_what_it_runs() -> None:
    model = Decoder(tiny_config(), device="cpu")
    assert model.runtime == "eager"
    model.runtime = "onnx"
    assert model.runtime == "onnx"
    model.runtime = "eager"
    assert model.runtime == "eager"
    with pytest.raises(ValueError, match=r"runtime: 'fast'; allowed: 'eager', 'onnx'"):
        Decoder(tiny_config(), device="cpu", runtime="fast")


@needs_onnxruntime
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Decoder(tiny_config(mla=MLAConfig(16, 8, 8, 16)), device="cpu", runtime="onnx"), "MLA.*allowed: MHA"),
        (lambda: Decoder(tiny_config(), device="cpu", weight_dtype="int8", runtime="onnx"), "allowed: 'fp32'"),
        (lambda: Decoder(tiny_config(dtype="bf16"), device="cpu", runtime="onnx"), "allowed: an fp32 model"),
    ],
    ids=["mla", "int8-weights", "bf16-model"],
)
def test_onnx_runtime_refuses_what_it_does_not_cover(build, match) -> None:
    with pytest.raises(ValueError, match=f"runtime: 'onnx' for .*{match}"):
        build()


@needs_onnxruntime
@pytest.mark.parametrize("tokens", [torch.tensor([1.7]), torch.tensor([True])], ids=["float", "bool"])
@pytest.mark.parametrize("runtime", ["eager", "onnx"])
def test_a_decode_step_refuses_token_ids_that_are_not_integers(tokens, runtime) -> None:
    """ONNX Runtime's embedding would read 1.7 as token 1: both runtimes refuse, by name."""
    model = Decoder(tiny_config(), device="cpu", runtime=runtime)
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match=r"tokens: dtype torch\.(float32|bool); allowed: integer token ids"):
        model.decode_step(tokens, cache)
    assert cache.length == 0


@needs_onnxruntime
def test_onnx_runtime_refuses_a_model_cast_or_moved_after_it_was_built() -> None:
    model = Decoder(tiny_config(), device="cpu", runtime="onnx")
    model.double()  # refused by the Decoder for every runtime, before ONNX Runtime sees it
    with pytest.raises(ValueError, match=r"model: its parameters are torch.float64, but cfg.dtype is 'fp32'"):
        model.decode_step(torch.tensor([1]), model.new_cache(1, 4))
    model = Decoder(tiny_config(), device="cpu", runtime="onnx")
    model.layers[1].mlp.to("meta")  # one layer off the CPU: its address means nothing to ONNX Runtime
    for cache in (model.new_cache(1, 4), ContiguousKVCache.for_model(model, 1, 4)):  # one graph, or two a layer
        with pytest.raises(ValueError, match=r"mlp.w_gate_up.* on meta; allowed: contiguous fp32 tensors on the CPU"):
            model.decode_step(torch.tensor([1]), cache)


def test_onnx_runtime_without_onnxruntime_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails, as where it is not installed
    with pytest.raises(ValueError, match=r"onnxruntime are not installed: pip install -e \.\[onnx\]"):
        Decoder(tiny_config(), device="cpu", runtime="onnx")
