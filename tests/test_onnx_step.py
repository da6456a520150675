"""``Decoder(runtime="onnx")``: ONNX Runtime runs each layer's dense parts, the cache runs attention.

The runtime must compute the eager step's logits (to fp32 rounding: two kernels, so a tolerance, not equality) for
every attention layout it covers and under every cache kvlab has, ragged batches included; it must read the model's
weights as they are now, not as they were when it was built; and it must refuse, naming the field and what is
allowed, every model it does not cover.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest
import torch

from kvlab import Decoder
from kvlab.cache import PagedKVCache, SharedPrefixKVCache, StaticKVCache
from kvlab.model.layers import RMSNorm
from kvlab.spec.config import MLAConfig

from .helpers import tiny_config
from .test_composition import CACHES_UNDER_WINDOWS, WINDOWED

needs_onnxruntime = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="pip install -e .[onnx]",
)

TOL = dict(rtol=1e-4, atol=1e-4)


def pair(cfg, seed: int = 3) -> tuple[Decoder, Decoder]:
    """An eager model with random norm weights (at their initial ones, a graph that skipped a norm would still
    match) and the same weights under ``runtime="onnx"``."""
    eager = Decoder(cfg, device="cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    onnx = Decoder(cfg, device="cpu", runtime="onnx")
    onnx.load_state_dict(eager.state_dict())
    return eager, onnx


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
def test_onnx_runtime_computes_the_eager_steps_logits(overrides, batch, graph_runs) -> None:
    eager, onnx = pair(tiny_config(**overrides))
    tokens = torch.randint(0, eager.cfg.vocab_size, (batch, 12), generator=torch.Generator().manual_seed(5))
    assert decode_both(eager, onnx, lambda m: m.new_cache(batch, 16), tokens, 4) == 8
    assert graph_runs[0] == 8 * (2 * eager.cfg.n_layers + 1)  # two halves a layer, then the head, each step


STATIC = lambda m, b, c: StaticKVCache(m.new_cache(b, c).shape, b, c)  # noqa: E731


@needs_onnxruntime
@pytest.mark.parametrize("name", [n for n in CACHES_UNDER_WINDOWS if n != "shared-prefix"] + ["static"])
def test_onnx_runtime_under_every_cache(name: str) -> None:
    """Attention stays with the cache, so each cache (windows, sinks that re-rotate queries, heavy hitters, pages,
    codecs, a static slab) gives the eager step's logits: under sliding-window layers, or without them where it
    refuses windows."""
    tokens = torch.randint(0, WINDOWED.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    make_cache = lambda m: (STATIC if name == "static" else CACHES_UNDER_WINDOWS[name])(m, 2, 20)  # noqa: E731
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
def test_onnx_runtime_reads_the_weights_as_they_are_now() -> None:
    """Bound by address: a checkpoint loaded in place is read live; tensors replaced (``assign=True``), storage
    swapped (``.data =``) or a module replaced are bound anew at the next step, and so is a new batch size."""
    eager, onnx = pair(tiny_config())
    tokens = torch.tensor([[5, 17, 3, 99, 42, 7]] * 2)

    def step(model: Decoder, batch: int = 1) -> torch.Tensor:
        cache = model.new_cache(batch, 8)
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
def test_onnx_runtime_refuses_a_model_cast_or_moved_after_it_was_built() -> None:
    model = Decoder(tiny_config(), device="cpu", runtime="onnx")
    model.double()
    with pytest.raises(ValueError, match=r"runtime: 'onnx' for a torch.float64 model; allowed: an fp32 model"):
        model.decode_step(torch.tensor([1]), model.new_cache(1, 4))
    model = Decoder(tiny_config(), device="cpu", runtime="onnx")
    model.layers[1].mlp.to("meta")  # one layer off the CPU: its address means nothing to ONNX Runtime
    with pytest.raises(ValueError, match=r"m.mlp.w_gate_up.* on meta; allowed: contiguous fp32 tensors on the CPU"):
        model.decode_step(torch.tensor([1]), model.new_cache(1, 4))


def test_onnx_runtime_without_onnxruntime_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails, as where it is not installed
    with pytest.raises(ValueError, match=r"onnxruntime are not installed: pip install -e \.\[onnx\]"):
        Decoder(tiny_config(), device="cpu", runtime="onnx")
