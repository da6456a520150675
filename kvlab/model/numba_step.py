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
``pip install -e .[numba]``; its first step compiles (a few seconds, cached on disk after).

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
    transposed, ``[L, out, in]`` (a copy), the embedding and the final norm where the parameters lie."""

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

        self.embed = np.ascontiguousarray(array("embed.weight"))  # [V, d]
        self.norms = np.stack(
            [[array(f"layers.{i}.{n}.weight") for n in ("attn_norm", "mlp_norm")] for i in range(len(model.layers))]
        )
        self.wqkv, self.wo = stacked("attn.wqkv"), stacked("attn.wo")
        self.wgu, self.wdown = stacked("mlp.w_gate_up"), stacked("mlp.w_down")
        self.final_norm = np.ascontiguousarray(array("norm.weight"))
        # A tied head is the embedding, already [V, d]: read where it lies.
        self.head = self.embed if model.lm_head is None else np.ascontiguousarray(array("lm_head").T)
        self.n_heads = model.cfg.n_heads

    def arguments(self, model: nn.Module) -> tuple:
        """``numba_kernels.step``'s ``weights``: these arrays, and the norms' epsilons and the softmax scales as
        ``model`` holds them now. The eager step reads those at every step (each ``RMSNorm``'s ``_eps``, each
        ``Attention``'s ``scale``), and a write to them bumps no parameter's version."""
        layers = model.layers
        eps = np.array([[b.attn_norm._eps.item(), b.mlp_norm._eps.item()] for b in layers], dtype=np.float32)
        scales = np.array([b.attn.scale for b in layers], dtype=np.float32)
        final_eps = np.float32(model.norm._eps.item())
        return (
            *(self.embed, self.norms, eps, self.wqkv, self.wo, self.wgu, self.wdown, scales),
            *(self.final_norm, final_eps, self.head),
        )


class NumbaStep:
    """``model``'s decode step as one compiled call (see the module docstring). ``step(tokens [B, 1], cache)`` ->
    logits ``[B, vocab]``, as ``Decoder.decode_step``. Steps run one at a time: a lock serialises threads that share
    the model."""

    runtime = "numba"

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"runtime: 'numba' for {reason}")
        self.model = model
        self.watch = ParameterWatch(model, copies=True)
        self.weights: _Weights | None = None
        self.slabs: tuple[weakref.ref[KVCache], tuple, tuple] | None = None  # a cache and its slabs as arrays
        self.lock = threading.Lock()

    def _bind(self, cache: ContiguousKVCache) -> None:
        """Hold ``cache``'s slabs as arrays for the steps on it, until a step on another cache or until ``cache`` is
        freed: the arrays keep the slabs' memory alive, so they are let go of with the cache."""
        step = weakref.ref(self)

        def forget(ref: weakref.ref) -> None:
            held = step()
            if held is not None and held.slabs is not None and held.slabs[0] is ref:
                held.slabs = None

        slabs = [cache.slabs(layer) for layer in range(cache.shape.n_layers)]
        keys, values = tuple(k.numpy() for k, _ in slabs), tuple(v.numpy() for _, v in slabs)
        self.slabs = (weakref.ref(cache, forget), keys, values)

    @staticmethod
    def reads(cache: KVCache) -> bool:
        """Whether a step on ``cache`` runs compiled: a ``ContiguousKVCache`` of fp32 with key-major keys."""
        return type(cache) is ContiguousKVCache and cache.key_major and cache.codec == "fp32"

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        model = self.model
        if not self.reads(cache):
            return model._run(tokens, cache)[:, -1]
        with self.lock:
            if self.weights is None or self.watch.stale():
                reason = unsupported(model)
                if reason is not None:  # the model was moved, cast or given another module after it was built
                    raise ValueError(f"runtime: 'numba' for {reason}")
                self.watch.reset()
                self.weights = _Weights(model) if self.watch.versioned else None
            if self.weights is None:  # inference-mode parameters: an edit in place would go unseen
                return model._run(tokens, cache)[:, -1]
            if self.slabs is None or self.slabs[0]() is not cache:
                self._bind(cache)
            start = cache.reserve(1)
            cos, sin = model.angles(start, 1)
            # Fresh logits at every step, as the eager step returns: a caller may keep them.
            logits = torch.empty(tokens.shape[0], model.cfg.vocab_size)
            try:
                ids, angles = np.ascontiguousarray(tokens[:, 0].numpy()), (cos[0, 0].numpy(), sin[0, 0].numpy())
                keys, values = self.slabs[1:]
                weights, n_heads = self.weights.arguments(model), self.weights.n_heads
                _compiled().step(ids, start, *angles, weights, keys, values, n_heads, logits.numpy())
            except Exception:
                cache.truncate(start)  # the step did not happen: its slot is not the cache's
                raise
            return logits
