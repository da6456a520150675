"""``Decoder(runtime="numba")``: the whole decode step as one call compiled by numba, on a contiguous fp32 cache with
key-major keys (what ``new_cache`` makes); every other cache runs the eager step.

The runtime must compute the eager step's logits (to fp32 rounding: its sums run in another order, so a tolerance)
for every attention layout it covers, ragged head sizes and batches included; it must leave in the cache the K/V the
eager step stores; it must read the model's weights as they are now; and it must refuse, naming the field and what is
allowed, every model it does not cover.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import pytest
import torch

from kvlab import Decoder
from kvlab.cache import ContiguousKVCache, PagedKVCache
from kvlab.cache.base import CacheCapacityError
from kvlab.model.attention import Attention
from kvlab.spec.config import MLAConfig

from .helpers import assert_greedy_picks, first_step_logits, runtime_pair, tiny_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="pip install -e .[numba]")

TOL = dict(rtol=1e-4, atol=1e-4)


pair = functools.partial(runtime_pair, runtime="numba")


@pytest.fixture
def compiled_runs(monkeypatch) -> list[int]:
    """Counts the compiled steps run, so that a test sees the runtime really ran (the eager fallback would give the
    same logits)."""
    from kvlab.model import numba_kernels

    runs, step = [0], numba_kernels.step

    def counted(*args):
        runs[0] += 1
        return step(*args)

    monkeypatch.setattr(numba_kernels, "step", counted)
    return runs


@torch.inference_mode()
def decode_both(eager: Decoder, other: Decoder, make_cache, tokens: torch.Tensor, n_prefill: int) -> list:
    """Prefill ``tokens[:, :n_prefill]``, then decode the rest one step at a time on each model's own cache; asserts
    every step's logits agree and returns the two caches."""
    caches = make_cache(eager), make_cache(other)
    for model, cache in zip((eager, other), caches, strict=True):
        model.prefill(tokens[:, :n_prefill], cache)
    for i in range(n_prefill, tokens.shape[1]):
        want, got = (m.decode_step(tokens[:, i], c) for m, c in zip((eager, other), caches, strict=True))
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, i=i: f"step {i}: {m}")
    return list(caches)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 4},
        {"n_kv_heads": 1},
        {"tie_embeddings": True},
        {"head_dim": 32},  # n_heads x head_dim != d_model, and four of the eight-row key passes
        {"head_dim": 12, "n_heads": 6, "n_kv_heads": 3},  # one eight-row pass, then four single rows
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
    ids=["gqa", "mha", "mqa", "tied-head", "wide-heads", "odd-head-dim", "llama3-rope"],
)
@pytest.mark.parametrize("batch", [1, 5])
def test_numba_runtime_computes_the_eager_steps_logits_and_kv(overrides, batch, compiled_runs) -> None:
    """Steps past 4 and 8 tokens, so that the value passes of four tokens end on a remainder and on none; a batch of
    5, so that the products take four sequences at a time, then one."""
    eager, compiled = pair(tiny_config(**overrides))
    tokens = torch.randint(0, eager.cfg.vocab_size, (batch, 14), generator=torch.Generator().manual_seed(5))
    caches = decode_both(eager, compiled, lambda m: m.new_cache(batch, 16), tokens, 3)
    assert compiled_runs[0] == 11
    for layer in range(eager.cfg.n_layers):
        for want, got in zip(*(c.read(layer) for c in caches), strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_numba_runtime_fills_the_cache_to_its_last_slot_and_refuses_one_more(compiled_runs) -> None:
    eager, compiled = pair(tiny_config())
    tokens = torch.randint(0, eager.cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    caches = decode_both(eager, compiled, lambda m: m.new_cache(1, 8), tokens, 1)
    assert caches[1].length == 8 and compiled_runs[0] == 7
    with pytest.raises(CacheCapacityError, match="KV cache full"):
        compiled.decode_step(tokens[:, 0], caches[1])
    assert caches[1].length == 8


def test_numba_runtime_gives_back_the_slot_of_a_step_that_failed(monkeypatch) -> None:
    from kvlab.model import numba_kernels

    model = Decoder(tiny_config(), device="cpu", runtime="numba")
    cache = model.new_cache(1, 8)
    model.prefill(torch.tensor([[1, 2]]), cache)

    def fails(*_):
        raise RuntimeError("the compiled step failed")

    monkeypatch.setattr(numba_kernels, "step", fails)
    with pytest.raises(RuntimeError, match="the compiled step failed"):
        model.decode_step(torch.tensor([3]), cache)
    assert cache.length == 2


@pytest.mark.parametrize(
    "make_cache",
    [
        lambda m: PagedKVCache.for_model(m, 2, 16, block_size=4),
        lambda m: ContiguousKVCache.for_model(m, 2, 16, key_major=False),
        lambda m: m.new_cache(2, 16, kv_dtype="int8"),
    ],
    ids=["paged", "token-major-keys", "int8-codec"],
)
def test_numba_runtime_runs_the_eager_step_on_a_cache_it_does_not_read(make_cache, compiled_runs) -> None:
    eager, compiled = pair(tiny_config())
    tokens = torch.randint(0, eager.cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    decode_both(eager, compiled, make_cache, tokens, 3)
    assert compiled_runs[0] == 0


def test_numba_runtime_generates_the_eager_models_tokens() -> None:
    eager, compiled = pair(tiny_config(n_kv_heads=1))
    prompt = torch.randint(0, eager.cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(8))
    out = compiled.generate(prompt, 12)
    with torch.inference_mode():
        logits = eager(torch.cat([prompt, out], dim=1))[:, prompt.shape[1] - 1 : -1]
    assert_greedy_picks(out, logits, **TOL)


@pytest.mark.parametrize("inference_tensors", [False, True], ids=["versioned", "made-under-inference-mode"])
def test_numba_runtime_reads_weights_changed_through_the_parameters(inference_tensors: bool, compiled_runs) -> None:
    """The step holds a transposed copy of the weights, made again when a parameter's version moves (a checkpoint
    loaded in place, a weight scaled in place). Parameters made under inference mode keep no version, so their
    steps run eager (no compiled run) and read the weights as they are."""
    with torch.inference_mode(inference_tensors):
        eager, compiled = pair(tiny_config())

    def edit(fn) -> None:
        with torch.inference_mode(inference_tensors), torch.no_grad():
            for model in (eager, compiled):
                fn(model)

    before = first_step_logits(compiled)
    torch.testing.assert_close(before, first_step_logits(eager), **TOL)
    edit(lambda m: m.load_state_dict(Decoder(tiny_config(), device="cpu", seed=9).state_dict()))
    loaded = first_step_logits(compiled)
    assert not torch.allclose(loaded, before)
    torch.testing.assert_close(loaded, first_step_logits(eager), **TOL)
    edit(lambda m: m.layers[1].mlp.w_down.mul_(3))
    scaled = first_step_logits(compiled)
    assert not torch.allclose(scaled, loaded)
    torch.testing.assert_close(scaled, first_step_logits(eager), **TOL)
    assert compiled_runs[0] == (0 if inference_tensors else 3)


def test_a_write_through_data_is_read_once_the_runtime_is_set_again() -> None:
    """``.data`` bumps no version: the copy keeps the values it was made with until the runtime is set again (the
    module docstring says so)."""
    eager, compiled = pair(tiny_config())
    before = first_step_logits(compiled)
    for model in (eager, compiled):
        model.layers[1].mlp.w_down.data.mul_(3)
    torch.testing.assert_close(first_step_logits(compiled), before, **TOL)  # stale, as documented
    compiled.runtime = "numba"
    torch.testing.assert_close(first_step_logits(compiled), first_step_logits(eager), **TOL)


def test_numba_runtime_is_settable_and_says_what_it_runs() -> None:
    model = Decoder(tiny_config(), device="cpu")
    model.runtime = "numba"
    assert model.runtime == "numba"
    assert model.new_cache(1, 4).key_major  # the layout its attention reads
    model.runtime = "eager"
    assert model.runtime == "eager"
    with pytest.raises(ValueError, match=r"runtime: 'fast'; allowed: 'eager', 'onnx', 'onnx-packed', 'numba'"):
        Decoder(tiny_config(), device="cpu", runtime="fast")


class HalvedAttention(Attention):
    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return super().output(attended) / 2


def with_halved_attention() -> Decoder:
    model = Decoder(tiny_config(), device="cpu")
    model.layers[1].attn.__class__ = HalvedAttention
    model.runtime = "numba"
    return model


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Decoder(tiny_config(mla=MLAConfig(16, 8, 8, 16)), device="cpu", runtime="numba"), "MLA.*allowed: MHA"),
        (lambda: Decoder(tiny_config(), device="cpu", weight_dtype="int8", runtime="numba"), "allowed: 'fp32'"),
        (lambda: Decoder(tiny_config(dtype="bf16"), device="cpu", runtime="numba"), "allowed: an fp32 model"),
        (
            lambda: Decoder(tiny_config(layer_windows=(4, None)), device="cpu", runtime="numba"),
            "sliding-window layers; allowed: every layer global",
        ),
        (with_halved_attention, "layer 1: a module of another kind.*allowed: the model's own modules"),
    ],
    ids=["mla", "int8-weights", "bf16-model", "windowed", "subclassed-attention"],
)
def test_numba_runtime_refuses_what_it_does_not_cover(build, match) -> None:
    with pytest.raises(ValueError, match=f"runtime: 'numba' for .*{match}"):
        build()


def test_numba_runtime_refuses_a_model_moved_after_it_was_built() -> None:
    model = Decoder(tiny_config(), device="cpu", runtime="numba")
    model.layers[1].mlp.to("meta")  # one layer off the CPU
    with pytest.raises(ValueError, match=r"layers.1.mlp.w_gate_up.* on meta; allowed: fp32 tensors on the CPU"):
        model.decode_step(torch.tensor([1]), model.new_cache(1, 4))


def test_numba_runtime_without_numba_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # import fails, as where it is not installed
    with pytest.raises(ValueError, match=r"numba is not installed: pip install -e \.\[numba\]"):
        Decoder(tiny_config(), device="cpu", runtime="numba")


@pytest.mark.parametrize("where", ["weight", "cache"])
def test_numba_runtime_gives_nan_where_the_eager_step_does(where: str, compiled_runs) -> None:
    """A NaN in a weight or in a cached key reaches the logits, as under eager: no clamp or fast-math flag turns it
    into a number."""
    eager, compiled = pair(tiny_config())
    caches = [m.new_cache(1, 8) for m in (eager, compiled)]
    for model, cache in zip((eager, compiled), caches, strict=True):
        model.prefill(torch.tensor([[1, 2, 3]]), cache)
        with torch.no_grad():
            if where == "weight":
                model.layers[0].mlp.w_down[0, 0] = float("nan")
            else:
                cache.slabs(1)[0][0, 0, 0, 1] = float("nan")  # layer 1, head 0, channel 0 of token 1
    want, got = (m.decode_step(torch.tensor([4]), c) for m, c in zip((eager, compiled), caches, strict=True))
    assert want.isnan().all() and got.isnan().all()
    assert compiled_runs[0] == 1


def test_numba_runtime_refuses_a_module_replaced_after_it_was_set() -> None:
    """A replaced module registers, so the next step checks the model again: refused by name, not run as kvlab's own
    arithmetic."""
    model = Decoder(tiny_config(), device="cpu", runtime="numba")
    cache = model.new_cache(1, 8)
    model.decode_step(torch.tensor([1]), cache)
    halved = HalvedAttention(model.cfg, 1, model.weights)
    halved.load_state_dict(model.layers[1].attn.state_dict())
    model.layers[1].attn = halved
    with pytest.raises(ValueError, match=r"runtime: 'numba' for layer 1: a module of another kind"):
        model.decode_step(torch.tensor([2]), cache)
    assert cache.length == 1


def test_numba_runtime_reads_the_norms_epsilon_and_the_softmax_scale_as_they_are_now(compiled_runs) -> None:
    """Eager reads each norm's ``_eps`` and each attention's ``scale`` at every step, and changing them bumps no
    parameter's version: the compiled step reads them at every step too."""
    eager, compiled = pair(tiny_config())
    before = first_step_logits(compiled)
    for model in (eager, compiled):
        model.layers[0].attn.scale *= 4
        model.layers[1].mlp_norm._eps.fill_(0.5)
        model.norm._eps.fill_(0.25)
    after = first_step_logits(compiled)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, first_step_logits(eager), **TOL)
    assert compiled_runs[0] == 2


def test_numba_runtime_follows_a_head_set_to_none_and_lets_go_of_a_freed_cache(compiled_runs) -> None:
    import gc
    import weakref

    eager, compiled = pair(tiny_config())
    for model in (eager, compiled):
        model.lm_head = None  # tied to the embedding from now on: no registration, a parameter gone
    cache = compiled.new_cache(1, 8)
    with torch.inference_mode():
        torch.testing.assert_close(
            compiled.decode_step(torch.tensor([3]), cache), eager.decode_step(torch.tensor([3]), eager.new_cache(1, 8))
        )
    slab = weakref.ref(cache.slabs(0)[0].untyped_storage())
    del cache
    gc.collect()
    assert slab() is None  # the step's arrays over the slabs went with the cache
    assert compiled_runs[0] == 1


@pytest.mark.parametrize("bad", [-1, 101])
def test_numba_runtime_refuses_ids_outside_the_vocabulary_and_keeps_the_cache(bad: int, compiled_runs) -> None:
    """The compiled step checks the ids itself, before it writes anything: the error names them, as eager's does."""
    model = Decoder(tiny_config(), device="cpu", runtime="numba")  # vocab_size 101
    cache = model.new_cache(2, 8)
    model.prefill(torch.tensor([[1, 2], [3, 4]]), cache)
    before = [t.clone() for t in cache.read(0)]
    with pytest.raises(
        ValueError, match=rf"tokens: ids {min(bad, 5)}\.\.{max(bad, 5)}; allowed: 0 <= id < vocab_size=101"
    ):
        model.decode_step(torch.tensor([5, bad]), cache)
    assert cache.length == 2 and compiled_runs[0] == 1
    for want, got in zip(before, cache.read(0), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_numba_runtime_refuses_an_id_past_a_smaller_embedding() -> None:
    """An embedding replaced by a smaller one: eager's index error, here a named refusal, never unwritten logits."""
    model = Decoder(tiny_config(), device="cpu", runtime="numba")
    model.embed = torch.nn.Embedding(50, model.cfg.d_model)
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match=r"tokens: an id outside the embedding's 50 rows"):
        model.decode_step(torch.tensor([60]), cache)
    assert cache.length == 0
