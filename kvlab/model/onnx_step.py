"""A decode step whose dense parts run in ONNX Runtime, with no Python between their operations:
``Decoder(cfg, runtime="onnx")``.

Why: a small model's decode step is a few dozen matrix products and a few hundred small operations. Eager PyTorch
pays microseconds of Python and dispatch for each of them, 2-2.5 ms of a 10-13 ms step on ``cpu-small`` on a 2-core
AMD EPYC (docs/cpu_performance.md, section G). ONNX Runtime runs a graph of the same operations from C++. What is left
in Python is attention on the cache, about 0.1 ms a layer at zero context. On that machine the step ran 7-15% faster
than the eager one in the same process, and its fitted weight term reached 79% of read bandwidth where the eager
step's reached 56% (section H).

How: each block is split at attention (``Block.before_attention`` and ``Block.after_attention``). Those two halves
and the LM head are exported from the model's own modules, once, with the weights left as graph inputs; each layer
binds them to its own parameters by address (no copy), so weights edited or loaded in place are read as they are.
Attention runs in between, in PyTorch, through the cache's own ``append`` and ``attend``: every cache kvlab has
(paged, windowed, quantized, heavy hitters, shared prefixes) works unchanged and reads the bytes it always read.

It covers what ``unsupported`` does not name: dense fp32 MHA/GQA/MQA models on the CPU, one new token per sequence
(prefill stays eager: it runs once per request, and its products are compute-bound). ``onnx`` and ``onnxruntime``
come with ``pip install -e .[onnx]``.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
import torch.nn as nn

from kvlab.cache.base import KVCache

# ``model`` below is a ``kvlab.model.decoder.Decoder``, which imports this module: typed as the nn.Module it is.

RUNTIMES: tuple[str, ...] = ("eager", "onnx")
INSTALL = "pip install -e .[onnx] (onnx and onnxruntime)"


def unsupported(model: nn.Module) -> str | None:
    """Why ``runtime="onnx"`` cannot run ``model``'s decode step, or None when it can."""
    if model.cfg.mla is not None:
        return "an MLA model (its attention does not split at the cache); allowed: MHA, GQA or MQA"
    if model.weight_dtype != "fp32" or model.torch_dtype != torch.float32:
        return (
            f"weights read in {model.weight_dtype}, a {model.torch_dtype} model; allowed: fp32 weights in an fp32 "
            "model (weight_dtype='fp32', dtype='fp32')"
        )
    if model.device.type != "cpu":
        return f"a model on {model.device}; allowed: the CPU (ONNX Runtime's CPU provider)"
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
    except ImportError:
        return f"onnx and onnxruntime are not installed: {INSTALL}"
    return None


class _Method(nn.Module):
    """``module.<method>`` as a module's ``forward``, for the exporter: ``module``'s parameters become graph inputs
    named ``m.<their name in module>``."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.m, self.method = module, method

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return getattr(self.m, self.method)(*args)


class _Graph:
    """One exported half: an ONNX Runtime session, its activation inputs and outputs, and the parameters (by name in
    the module it came from) that it reads."""

    def __init__(self, module: nn.Module, method: str, inputs: dict[str, torch.Tensor], outputs: list[str]) -> None:
        import onnxruntime

        buffer = io.BytesIO()
        # Traced on one sequence: one row never takes WeightFormat's column blocks, so every product is exported as
        # a plain MatMul, and the batch is then left free (dynamic_axes).
        free = {name: {0: "batch"} for name in [*inputs, *outputs]}
        with warnings.catch_warnings():
            # The TorchScript-based exporter is deprecated, and the tracer warns at each shape-dependent branch: a
            # decode step takes the same branches (one token) at every batch size.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _Method(module, method),
                tuple(inputs.values()),
                buffer,
                dynamo=False,
                export_params=False,
                # Folding would precompute a tied head's embed.weight.T into a new weight: a copy, and a graph input
                # no parameter is named after. ONNX Runtime folds what it can itself.
                do_constant_folding=False,
                input_names=list(inputs),
                output_names=outputs,
                dynamic_axes=free,
            )
        options = onnxruntime.SessionOptions()
        # One thread, on the caller's: ONNX Runtime's own pool and PyTorch's OpenMP threads, which run the attention
        # between the graphs, took the same cores from each other (docs/cpu_performance.md, section H).
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in self.session.get_inputs()]
        self.activations = [n for n in names if n in inputs]
        self.parameters = [n.removeprefix("m.") for n in names if n not in inputs]
        self.outputs = outputs

    def bind(self, module: nn.Module, activations: list[torch.Tensor], outputs: list[torch.Tensor]):
        """A binding of this graph to ``activations``, ``module``'s parameters and ``outputs``, all by address."""
        binding = self.session.io_binding()
        params = [module.get_parameter(name) for name in self.parameters]
        for name, t in zip(self.activations + [f"m.{p}" for p in self.parameters], activations + params, strict=True):
            binding.bind_input(name, "cpu", 0, np.float32, list(t.shape), _address(t, name))
        for name, t in zip(self.outputs, outputs, strict=True):
            bind_output(binding, name, t)
        return binding


def bind_output(binding, name: str, t: torch.Tensor) -> None:
    binding.bind_output(name, "cpu", 0, np.float32, list(t.shape), _address(t, name))


def _address(t: torch.Tensor, name: str) -> int:
    if not t.is_contiguous() or t.dtype != torch.float32:
        raise ValueError(f"{name}: a strided or non-fp32 tensor; allowed: contiguous fp32 tensors (bound by address)")
    return t.data_ptr()


class _Plan:
    """The buffers and bindings of a step at one batch size: built once, reused by every step at that size."""

    def __init__(self, step: OnnxStep, batch: int) -> None:
        cfg = step.model.cfg
        h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # The residual stream alternates between two buffers, so that no graph writes the tensor it reads.
        self.stream = [torch.zeros(batch, 1, cfg.d_model), torch.zeros(batch, 1, cfg.d_model)]
        self.cos, self.sin = torch.zeros(batch, 1, 1, d), torch.zeros(batch, 1, 1, d)
        self.q, self.attended = torch.zeros(batch, hkv, h // hkv, 1, d), torch.zeros(batch, hkv, h // hkv, 1, d)
        self.k, self.v = torch.zeros(batch, 1, hkv, d), torch.zeros(batch, 1, hkv, d)
        self.layers = []
        for i, block in enumerate(step.model.layers):
            x, y = self.stream[i % 2], self.stream[(i + 1) % 2]
            before = step.before.bind(block, [x, self.cos, self.sin], [self.q, self.k, self.v])
            after = step.after.bind(block, [x, self.attended], [y])
            self.layers.append((block, before, after))
        self.logits = torch.empty(batch, 1, cfg.vocab_size)
        self.head = step.head.bind(step.model, [self.stream[len(step.model.layers) % 2]], [self.logits])
        # A binding holds addresses only: these references keep the memory it reads alive.
        self.parameters = list(step.model.parameters())


class OnnxStep:
    """``model``'s decode step with each layer's dense parts in ONNX Runtime and attention on the cache (see the module
    docstring). ``step(tokens [B, 1], cache)`` -> logits ``[B, vocab]``, as ``Decoder.decode_step``.

    The graphs are exported when it is built (about 0.5 s). Each batch size gets its buffers and bindings at its first
    step; they are bound again if a parameter moves to new memory (``load_state_dict(assign=True)``, ``.data =``).
    """

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"runtime: 'onnx' for {reason}")
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
        self.plans: dict[int, _Plan] = {}
        # Where each parameter is held, so that a step can see cheaply whether one was replaced or moved (walking
        # model.parameters() took 0.1 ms, 1% of a step).
        self.holders = [(m._parameters, name) for m in model.modules() for name in m._parameters]
        self.addresses = self._addresses()

    def _addresses(self) -> list[int]:
        return [holder[name].data_ptr() for holder, name in self.holders]

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        model = self.model
        reason = unsupported(model)
        if reason is not None:  # the model was moved or cast after it was built
            raise ValueError(f"runtime: 'onnx' for {reason}")
        addresses = self._addresses()
        if addresses != self.addresses:
            self.plans.clear()
            self.addresses = addresses
        batch = tokens.shape[0]
        plan = self.plans.get(batch) or self.plans.setdefault(batch, _Plan(self, batch))
        cos, sin = model.angles(cache.reserve(1), 1)
        plan.cos.copy_(cos)
        plan.sin.copy_(sin)
        plan.stream[0].copy_(model.embed(tokens))
        for block, before, after in plan.layers:
            self.before.session.run_with_iobinding(before)
            plan.attended.copy_(block.attn.attend(plan.q, plan.k, plan.v, model.rope, cache))
            self.after.session.run_with_iobinding(after)
        # Fresh logits at every step, as the eager step returns: a caller may keep them.
        logits = torch.empty_like(plan.logits)
        bind_output(plan.head, "logits", logits)
        self.head.session.run_with_iobinding(plan.head)
        return logits[:, 0]
