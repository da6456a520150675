"""A decode step whose dense parts run in ONNX Runtime, with no Python between their operations:
``Decoder(cfg, runtime="onnx")``.

Why: a small model's decode step is a few dozen matrix products and a few hundred small operations. Eager PyTorch
pays microseconds of Python and dispatch for each of them, 2-2.5 ms of a 10-13 ms step on ``cpu-small`` on a 2-core
AMD EPYC (docs/cpu_performance.md, section G). ONNX Runtime runs a graph of the same operations from C++. What is left
in Python is attention on the cache, about 0.1 ms a layer at zero context. On that machine the zero-context step ran
7-15% faster than the eager one in the same process (section H).

How: each block is split at attention (``Block.before_attention`` and ``Block.after_attention``). Those two halves
and the LM head are exported from the model's own modules, once, with the weights left as graph inputs; each layer
binds them to its own parameters by address (no copy), so weights edited or loaded in place are read as they are.
Attention runs in between, in PyTorch, through the cache's own ``append`` and ``attend``: every cache kvlab has
(paged, windowed, quantized, heavy hitters, shared prefixes) works unchanged and reads the bytes it always read.

It covers what ``unsupported`` does not name: dense fp32 MHA/GQA/MQA models on the CPU, one new token per sequence
(prefill stays eager: it runs once per request, and its products are compute-bound). It runs the model's modules as
they were exported, so hooks on them do not fire, and a module replaced by one of another kind needs
``model.runtime = "onnx"`` again (a re-export). ``onnx`` and ``onnxruntime`` come with ``pip install -e .[onnx]``.
"""

from __future__ import annotations

import inspect
import io
import threading
import warnings

import numpy as np
import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks

from kvlab.cache.base import KVCache

# ``model`` below is a ``kvlab.model.decoder.Decoder``, which imports this module: typed as the nn.Module it is.

RUNTIMES: tuple[str, ...] = ("eager", "onnx")
INSTALL = "pip install -e .[onnx] (onnx and onnxruntime)"


def unsupported(model: nn.Module) -> str | None:
    """Why ``runtime="onnx"`` cannot run ``model``'s decode step, or None when it can."""
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
    except ImportError:
        return f"onnx and onnxruntime are not installed: {INSTALL}"
    return _model_problem(model)


def _model_problem(model: nn.Module) -> str | None:
    if model.cfg.mla is not None:
        return "an MLA model (its attention does not split at the cache); allowed: MHA, GQA or MQA"
    if model.weight_dtype != "fp32":
        return f"weight_dtype={model.weight_dtype!r}; allowed: 'fp32' (ONNX Runtime reads the fp32 parameters)"
    if model.torch_dtype != torch.float32:
        return f"a {model.torch_dtype} model; allowed: an fp32 model (ModelConfig dtype='fp32', or model.float())"
    if model.device.type != "cpu":
        return f"a model on {model.device}; allowed: the CPU (model.to('cpu'), or model.runtime = 'eager')"
    return None


# Counts every parameter or submodule registered on any module (setattr, load_state_dict(assign=True), ...), so that a
# step can tell cheaply that its bindings may be stale. Installed with the first OnnxStep.
_registrations = 0
_hooks_installed = False


def _count_registration(*_) -> None:
    global _registrations
    _registrations += 1


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        module_hooks.register_module_module_registration_hook(_count_registration)
        module_hooks.register_module_parameter_registration_hook(_count_registration)
        _hooks_installed = True


class _Method(nn.Module):
    """``module.<method>`` as a module's ``forward``, for the exporter: ``module``'s parameters become graph inputs
    named ``m.<their name in module>``."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.m, self.method = module, method

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return getattr(self.m, self.method)(*args)


# torch.onnx.export gained ``dynamo`` in torch 2.5 and made the new exporter the default later; these graphs are
# traced by the TorchScript-based one.
_TRACED = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}


class _Graph:
    """One exported half: an ONNX Runtime session, its activation inputs and outputs, and the parameters (by name in
    the module it came from) that it reads."""

    def __init__(self, module: nn.Module, method: str, inputs: dict[str, torch.Tensor], outputs: list[str]) -> None:
        import onnxruntime

        buffer = io.BytesIO()
        # Traced on one sequence: one row never takes WeightFormat's column blocks, so every product is exported as
        # a plain MatMul, and the batch is then left free (dynamic_axes).
        wrapper = _Method(module, method)
        # The exporter traces in eval mode, then sets the wrapper's mode on everything under it: put each back.
        modes = {m: m.training for m in module.modules()}
        free = {name: {0: "batch"} for name in [*inputs, *outputs]}
        with warnings.catch_warnings():
            # The TorchScript-based exporter is deprecated, and the tracer warns at each shape-dependent branch: a
            # decode step takes the same branches (one token) at every batch size.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                wrapper,
                tuple(inputs.values()),
                buffer,
                export_params=False,
                # Folding would precompute a tied head's embed.weight.T into a new weight: a copy, and a graph input
                # no parameter is named after. ONNX Runtime folds what it can itself.
                do_constant_folding=False,
                input_names=list(inputs),
                output_names=outputs,
                dynamic_axes=free,
                **_TRACED,
            )
        for m, training in modes.items():
            m.training = training
        options = onnxruntime.SessionOptions()
        # One thread, on the caller's: ONNX Runtime's own pool and PyTorch's OpenMP threads, which run the attention
        # between the graphs, took the same cores from each other (docs/cpu_performance.md, section H).
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])
        self.parameters = [i.name.removeprefix("m.") for i in self.session.get_inputs() if i.name not in inputs]

    def bind(self, module: nn.Module, activations: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
        """An ONNX Runtime binding of this graph, by name and address, to ``activations``, ``module``'s parameters
        and ``outputs``. Returns the binding and the tensors it reads from parameters."""
        binding = self.session.io_binding()
        params = {f"m.{name}": module.get_parameter(name).detach() for name in self.parameters}
        for name, t in (activations | params).items():
            binding.bind_input(name, "cpu", 0, np.float32, list(t.shape), _address(t, name))
        for name, t in outputs.items():
            bind_output(binding, name, t)
        return binding, list(params.values())


def bind_output(binding, name: str, t: torch.Tensor) -> None:
    """Bind the graph output ``name`` of ``binding`` (an ONNX Runtime IOBinding) to ``t``'s memory."""
    binding.bind_output(name, "cpu", 0, np.float32, list(t.shape), _address(t, name))


def _address(t: torch.Tensor, name: str) -> int:
    """``t``'s address, for a binding: ONNX Runtime reads it as contiguous fp32 on the CPU, so anything else is refused
    (a device pointer or a strided view would be read as garbage, or crash the process)."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        layout = "contiguous" if t.is_contiguous() else "strided"
        raise ValueError(
            f"runtime: 'onnx' reads {name} from memory, but it is a {layout} {t.dtype} tensor on {t.device}; allowed: "
            "contiguous fp32 tensors on the CPU (or set model.runtime = 'eager')"
        )
    return t.data_ptr()


class _Plan:
    """The buffers and bindings of a step at one batch size: built once, reused by every step at that size."""

    def __init__(self, step: OnnxStep, batch: int) -> None:
        model, cfg = step.model, step.model.cfg
        h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # The residual stream alternates between two buffers, so that no graph writes the tensor it reads.
        self.stream = [torch.zeros(batch, 1, cfg.d_model), torch.zeros(batch, 1, cfg.d_model)]
        self.cos, self.sin = torch.zeros(batch, 1, 1, d), torch.zeros(batch, 1, 1, d)
        self.q, self.attended = torch.zeros(batch, hkv, h // hkv, 1, d), torch.zeros(batch, hkv, h // hkv, 1, d)
        self.k, self.v = torch.zeros(batch, 1, hkv, d), torch.zeros(batch, 1, hkv, d)
        self.logits_shape = (batch, 1, cfg.vocab_size)
        # A binding holds addresses only: ``self.weights`` holds the tensors they point into, so that their memory
        # outlives the binding even if the model lets go of it (``.data =``, ``load_state_dict(assign=True)``).
        self.layers, self.weights = [], []
        for i, block in enumerate(model.layers):
            x, y = self.stream[i % 2], self.stream[(i + 1) % 2]
            before, w1 = step.before.bind(
                block, {"x": x, "cos": self.cos, "sin": self.sin}, {"q": self.q, "k": self.k, "v": self.v}
            )
            after, w2 = step.after.bind(block, {"x": x, "attended": self.attended}, {"y": y})
            self.layers.append((block, before, after))
            self.weights += w1 + w2
        last = self.stream[len(model.layers) % 2]
        self.head, w3 = step.head.bind(model, {"x": last}, {"logits": torch.empty(self.logits_shape)})
        self.weights += w3


class OnnxStep:
    """``model``'s decode step with each layer's dense parts in ONNX Runtime and attention on the cache (see the module
    docstring). ``step(tokens [B, 1], cache)`` -> logits ``[B, vocab]``, as ``Decoder.decode_step``.

    The graphs are exported when it is built (about 0.5 s). Each batch size gets its buffers and bindings at its first
    step; all are bound again when a parameter moved to new memory (``.data =``) or any module registered a new
    parameter or submodule (``load_state_dict(assign=True)``, a replaced layer). Steps run one at a time: a lock
    serialises threads that share the model, since every step at one batch size writes the same buffers.
    """

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"runtime: 'onnx' for {reason}")
        _install_hooks()
        self.model = model
        cfg = model.cfg
        block = model.layers[0]
        # Distinct example tensors: the tracer tells inputs apart by identity.
        d = cfg.head_dim
        x, cos, sin = torch.zeros(1, 1, cfg.d_model), torch.ones(1, 1, 1, d), torch.zeros(1, 1, 1, d)
        with torch.no_grad():
            q, _, _ = block.before_attention(x, cos, sin)
            self.before = _Graph(block, "before_attention", {"x": x, "cos": cos, "sin": sin}, ["q", "k", "v"])
            self.after = _Graph(block, "after_attention", {"x": x, "attended": torch.zeros_like(q)}, ["y"])
            self.head = _Graph(model, "_logits", {"x": x}, ["logits"])
        self.lock = threading.Lock()
        self._forget_plans()

    def _forget_plans(self) -> None:
        self.plans: dict[int, _Plan] = {}
        self.registrations = _registrations
        # Where each parameter is held, so that a step can see cheaply whether one moved (walking model.parameters()
        # each step took 0.1 ms, 1% of a step).
        self.holders = [
            (m._parameters, n) for m in self.model.modules() for n, p in m._parameters.items() if p is not None
        ]
        self.addresses = self._addresses()

    def _addresses(self) -> list[int]:
        return [holder[name].data_ptr() for holder, name in self.holders]

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        model = self.model
        reason = _model_problem(model)
        if reason is not None:  # the model was moved or cast after it was built
            raise ValueError(f"runtime: 'onnx' for {reason}")
        with self.lock:
            if self.registrations != _registrations or self._addresses() != self.addresses:
                self._forget_plans()
            batch = tokens.shape[0]
            if batch not in self.plans:
                self.plans[batch] = _Plan(self, batch)
            plan = self.plans[batch]
            cos, sin = model.angles(cache.reserve(1), 1)
            plan.cos.copy_(cos)
            plan.sin.copy_(sin)
            plan.stream[0].copy_(model.embed(tokens))
            for block, before, after in plan.layers:
                self.before.session.run_with_iobinding(before)
                plan.attended.copy_(block.attn.attend(plan.q, plan.k, plan.v, model.rope, cache))
                self.after.session.run_with_iobinding(after)
            # Fresh logits at every step, as the eager step returns: a caller may keep them.
            logits = torch.empty(plan.logits_shape)
            bind_output(plan.head, "logits", logits)
            self.head.session.run_with_iobinding(plan.head)
            return logits[:, 0]
