"""A decode step compiled by numba, one call a step: ``Decoder(cfg, runtime="numba")``.

Why: each decode step reads every weight once, so on a CPU its floor is the weights' bytes over the memory bandwidth.
The one-row products of PyTorch's kernels (MKL), numpy's (OpenBLAS) and ONNX Runtime's (MLAS) read weights stored
``[in, out]`` at 12-20 GB/s on a 2-core AMD EPYC (Zen 4), where the machine copies at 21-23 (docs/cpu_performance.md,
sections N and Q). A dot product of each ``[out, in]`` row with the activation streams the matrix front to back;
compiled by LLVM for the CPU it runs on, it read the same weights at 82-88% of copy when called once per matrix. So
this step holds the matrices transposed, ``[out, in]``, and runs the whole step, embedding to logits, in one compiled
function, with no Python and no PyTorch call between two products. There its zero-context step of cpu-small read
the weights at 95-108% of copy at one thread, 0.82-0.95x llama.cpp's F32 step (section Q).

What it holds: a copy of every projection matrix, transposed, and of the layers' norm weights (the weights' bytes
once more; the embedding, a tied head and the final norm are read where they lie). The copy is made at the first step
and again when a parameter has changed since: an edit through the parameter (``load_state_dict``, an operation in
place under ``no_grad``) bumps its version, a move (``.data =``, a cast) its address, and a new parameter or
submodule registers (on any model: every step made in the process copies again once). A write through ``.data`` or
a numpy view bumps nothing: to a copied weight it goes unseen until ``model.runtime = "numba"`` is set again. A
model whose parameters were made under inference mode keeps no versions, so its steps run eager. A module replaced
by one of another kind is refused at the next step; one whose ``__class__`` is reassigned registers nothing, so set
the runtime again after that.

What it covers (``unsupported`` names the rest): dense fp32 MHA/GQA/MQA models of kvlab's own modules on the CPU,
with no sliding-window layer, one new token per sequence, on a ``ContiguousKVCache`` of fp32 (what
``Decoder.new_cache`` makes for such a model). On any other cache the eager step runs, and prefill is always eager:
it runs once per request, and its products are compute-bound. It runs on one thread. ``numba`` comes with
``pip install -e .[numba]``; its first step compiles (about 10 s on a 2-core machine), and the result is cached
on disk.

The arithmetic is the eager step's, reassociated: sums run in another order (fastmath, so that LLVM vectorises them),
so logits agree with eager's to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch
import torch.nn as nn

from kvlab.cache.base import KVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.model.attention import Attention
from kvlab.model.layers import RMSNorm, SwiGLU
from kvlab.model.runtimes import ParameterWatch, model_problem

INSTALL = "pip install -e .[numba]"


def unsupported(model: nn.Module) -> str | None:
    """Why ``runtime="numba"`` cannot run ``model``'s decode step, or None when it can."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return f"numba is not installed: {INSTALL}"
    reason = model_problem(model)
    if reason is not None:
        return reason
    if any(model.cfg.layer_windows or ()):
        return "a model with sliding-window layers; allowed: every layer global (or model.runtime = 'eager')"
    for i, block in enumerate(model.layers):
        kinds = (type(block.attn) is Attention, type(block.mlp) is SwiGLU)
        if not all(kinds) or not all(type(n) is RMSNorm for n in (block.attn_norm, block.mlp_norm)):
            return (
                f"layer {i}: a module of another kind than kvlab's Attention, SwiGLU and RMSNorm; allowed: the model's "
                "own modules (this step compiles their arithmetic), or model.runtime = 'eager'"
            )
    if type(model.norm) is not RMSNorm:
        return (
            "a final norm of another kind than kvlab's RMSNorm; allowed: the model's own (or model.runtime = 'eager')"
        )
    return None


def _compiled():
    """The compiled step's kernels: importing numba costs about 0.3 s, so not before a model asks for this runtime."""
    from kvlab.model import numba_kernels

    return numba_kernels


class _Weights:
    """The arrays the compiled step reads, made from ``model``'s parameters: the projections stacked by layer and
    transposed, ``[L, out, in]``, and the layers' norm weights (copies); the embedding and the final norm where the
    parameters lie; the norms' epsilons and the softmax scales as the model holds them now."""

    def __init__(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())

        def array(name: str) -> np.ndarray:
            t = params[name]
            if t.device.type != "cpu" or t.dtype != torch.float32:
                raise ValueError(
                    f"runtime: numba reads {name} from memory, but it is a {t.dtype} tensor on {t.device}; allowed: "
                    "fp32 tensors on the CPU (or set model.runtime = 'eager')"
                )
            return t.detach().numpy()

        def stacked(kind: str) -> np.ndarray:  # [L, out, in], a copy
            return np.ascontiguousarray(np.stack([array(f"layers.{i}.{kind}").T for i in range(len(model.layers))]))

        layers = model.layers
        embed = np.ascontiguousarray(array("embed.weight"))  # [V, d]
        norms = np.stack(
            [[array(f"layers.{i}.{n}.weight") for n in ("attn_norm", "mlp_norm")] for i in range(len(layers))]
        )
        # Eager reads each RMSNorm's _eps buffer (watched, ParameterWatch's buffers) and each Attention's scale (an
        # attribute: NumbaStep compares them at every step).
        eps = np.array([[b.attn_norm._eps.item(), b.mlp_norm._eps.item()] for b in layers], dtype=np.float32)
        self.scales = [b.attn.scale for b in layers]
        # A tied head is the embedding, already [V, d]: read where it lies.
        head = embed if model.lm_head is None else np.ascontiguousarray(array("lm_head").T)
        self.arguments = (
            *(embed, norms, eps, stacked("attn.wqkv"), stacked("attn.wo"), stacked("mlp.w_gate_up")),
            *(
                stacked("mlp.w_down"),
                np.array(self.scales, dtype=np.float32),
                np.ascontiguousarray(array("norm.weight")),
            ),
            *(np.float32(model.norm._eps.item()), head),
        )  # numba_kernels.step's weights, in its order


class _Plan:
    """Everything a step on one cache passes the compiled step but the tokens, made once for the weights' copy and
    the cache, so that a step runs as little Python as it can: Python run between two steps finds its code and data
    evicted by the weights' stream, and costs several times what it costs in a loop of its own. On cpu-small the
    Python around the compiled call took about 0.8 ms a step before this plan and 0.5 after (docs/cpu_performance.md,
    section Q).

    It holds the cache's slabs as arrays, which keep the slabs' memory alive: a weak reference to the cache lets go
    of it when the cache is freed (``NumbaStep.plan`` is cleared). RoPE's angles are read from the model's own table,
    ``RotaryEmbedding.span``'s, grown as positions pass its end."""

    def __init__(self, step: NumbaStep, weights: _Weights, cache: ContiguousKVCache) -> None:
        owner = weakref.ref(step)

        def forget(ref: weakref.ref) -> None:
            held = owner()
            if held is not None and held.plan is not None and held.plan.cache is ref:
                held.plan = None

        self.cache, self.weights = weakref.ref(cache, forget), weights
        slabs = [cache.slabs(layer) for layer in range(cache.shape.n_layers)]
        keys, values = tuple(k.numpy() for k, _ in slabs), tuple(v.numpy() for _, v in slabs)
        self.arguments = (weights.arguments, keys, values, step.model.cfg.n_heads)
        self.table: tuple[np.ndarray, ...] = ()  # RoPE's cos and sin tables, as last read
        self.positions = 0  # their length

    def angles(self, rope: nn.Module, start: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE's tables ``[positions, D]``, holding position ``start``."""
        if start >= self.positions:
            rope.span(start, 1)  # grows the table to hold it
            self.table = tuple(t.numpy().reshape(t.shape[0], t.shape[-1]) for t in (rope._cos, rope._sin))
            self.positions = self.table[0].shape[0]
        return self.table


class NumbaStep:
    """``model``'s decode step as one compiled call (see the module docstring). ``step(tokens [B, 1], cache)`` ->
    logits ``[B, vocab]``, as ``Decoder.decode_step``. Steps run one at a time: a lock serialises threads that share
    the model."""

    runtime = "numba"
    checks_ids = True  # the compiled step checks the token ids, and the eager step it falls back to does too

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"runtime: 'numba' for {reason}")
        self.model = model
        self.watch = ParameterWatch(model, copies=True, buffers=("_eps",))
        self.weights: _Weights | None = None
        self.plan: _Plan | None = None
        self.lock = threading.Lock()

    @staticmethod
    def reads(cache: KVCache) -> bool:
        """Whether a step on ``cache`` runs compiled: a ``ContiguousKVCache`` of fp32 with key-major keys."""
        return type(cache) is ContiguousKVCache and cache.key_major and cache.codec == "fp32"

    def _stale(self) -> bool:
        weights = self.weights
        return weights is None or self.watch.stale() or [b.attn.scale for b in self.model.layers] != weights.scales

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        model = self.model
        if not self.reads(cache):
            return model._run(tokens, cache)[:, -1]
        with self.lock:
            if self._stale():
                reason = unsupported(model)
                if reason is not None:  # the model was moved, cast or given another module after it was built
                    raise ValueError(f"runtime: 'numba' for {reason}")
                self.watch.reset()
                self.weights = _Weights(model) if self.watch.versioned else None
            if self.weights is None:  # inference-mode parameters: an edit in place would go unseen
                return model._run(tokens, cache)[:, -1]
            plan = self.plan
            if plan is None or plan.cache() is not cache or plan.weights is not self.weights:
                plan = self.plan = _Plan(self, self.weights, cache)
            ids = tokens.numpy().reshape(-1)
            if ids.dtype != np.int64:
                ids = ids.astype(np.int64)
            start = cache.reserve(1)
            # Fresh logits at every step, as the eager step returns: a caller may keep them.
            logits = torch.empty(ids.shape[0], model.cfg.vocab_size)
            try:
                ran = _compiled().step(ids, start, *plan.angles(model.rope, start), *plan.arguments, logits.numpy())
                if not ran:
                    model._check_ids(tokens)  # raises, naming the ids
                    # The compiled step bounds ids by the embedding's rows, eager by cfg.vocab_size: never return
                    # the unwritten logits if the two ever disagree.
                    raise ValueError(
                        f"tokens: an id outside the embedding's {model.embed.weight.shape[0]} rows; allowed: "
                        f"0 <= id < vocab_size={model.cfg.vocab_size}, with an embedding of that many rows"
                    )
            except Exception:
                cache.truncate(start)  # the step did not happen: its slot is not the cache's
                raise
            return logits
