"""A decode step whose dense parts run in ONNX Runtime, with no Python between their operations:
``Decoder(cfg, runtime="onnx")``.

Why: a small model's decode step is a few dozen matrix products and a few hundred small operations. Eager PyTorch
pays microseconds of Python and dispatch for each of them, 2-2.5 ms of a 10-13 ms step on ``cpu-small`` on a 2-core
AMD EPYC (docs/cpu_performance.md, section G). ONNX Runtime runs a graph of the same operations from C++.

How: the graphs are exported from the model's own modules, with the weights left as graph inputs. Two shapes of
step:

- **One graph a step**, on the cache ``Decoder.new_cache`` makes under this runtime: a ``ContiguousKVCache`` of
  fp32 whose keys are token-major, ``[B, Hkv, capacity, D]`` like its values. That is the layout ONNX Runtime's
  ``GroupQueryAttention`` operator reads and writes in place, so the embedding, every layer with its attention, and
  the head run as one graph over the cache's own slabs, with no PyTorch operation between two steps' weight reads.
  It writes kvlab's ``Attention`` out for one token, every size but the batch a constant, and each ``RMSNorm`` as
  ONNX Runtime's ``SimplifiedLayerNormalization``: 189 operators a step on cpu-small, where a trace of the block's
  halves ran 580 (docs/cpu_performance.md, section P); a model whose attention is another module keeps the split
  graphs. Under ``runtime="onnx"`` its weights are bound to the parameters by address (no copy), so weights edited or
  loaded in place are read as they are. Under ``runtime="onnx-packed"`` its session holds them as initializers,
  read from the parameters' memory, so ONNX Runtime repacks the matrices into its own layout once, when it makes
  the session. That copy (about 1.4 times the weights' bytes again per thread count a step has run at, measured as
  the process's peak) streams faster: the zero-context step took 6.4-7.5 ms against 8.1-9.9 with the weights bound,
  on cpu-small (section L). It holds the values the weights had when it was made: an edit through the parameter
  (``load_state_dict``, an operation in place under ``no_grad``) bumps its version and the next step makes the
  session again (about 0.2 s on cpu-small), but a write through ``.data`` or a numpy view bumps nothing and goes
  unseen until ``model.runtime = "onnx-packed"`` is set again. A model whose parameters were made under inference
  mode keeps no versions, so its weights are bound instead, as under ``runtime="onnx"``.
- **Two graphs a layer**, on every other cache: each block is split at attention (``Block.before_attention`` and
  ``Block.after_attention``), and attention runs in between, in PyTorch, through the cache's own ``append`` and
  ``attend``. Every cache kvlab has (paged, windowed, quantized, heavy hitters, shared prefixes, key-major slabs)
  works unchanged and reads the bytes it always read. The weights are bound to the parameters by address (no
  copy), so weights edited or loaded in place are read as they are, under either runtime. About 0.1 ms a layer stays
  in Python; 7-15% faster than eager (section H).

It covers what ``unsupported`` does not name: dense fp32 MHA/GQA/MQA models on the CPU, one new token per sequence
(prefill stays eager: it runs once per request, and its products are compute-bound). It runs the model's modules as
they were exported, so hooks on them do not fire, and a module replaced by one of another kind needs
``model.runtime`` set to its value again (a re-export). ``onnx`` and ``onnxruntime`` come with
``pip install -e .[onnx]``.
"""

from __future__ import annotations

import functools
import inspect
import io
import threading
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from kvlab.cache.base import KVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.model.attention import Attention
from kvlab.model.layers import RMSNorm, apply_rope, rope_angles
from kvlab.model.runtimes import ParameterWatch, model_problem

# ``model`` below is a ``kvlab.model.decoder.Decoder``, which imports this module: typed as the nn.Module it is.

Outputs = torch.Tensor | tuple[torch.Tensor, ...]
INSTALL = "pip install -e .[onnx] (onnx and onnxruntime)"


def unsupported(model: nn.Module) -> str | None:
    """Why ``runtime="onnx"`` cannot run ``model``'s decode step, or None when it can."""
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
    except ImportError:
        return f"onnx and onnxruntime are not installed: {INSTALL}"
    return model_problem(model)


class _Method(nn.Module):
    """``fn(module, *inputs)`` as a module's ``forward``, for the exporter: ``module``'s parameters become graph inputs
    named ``m.<their name in module>``."""

    def __init__(self, module: nn.Module, fn: Callable[..., Outputs]) -> None:
        super().__init__()
        self.m, self.fn = module, fn

    def forward(self, *args: torch.Tensor) -> Outputs:
        return self.fn(self.m, *args)


# torch.onnx.export gained ``dynamo`` in torch 2.5 and made the new exporter the default later; these graphs are
# traced by the TorchScript-based one.
_TRACED = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}


class _Graph:
    """One exported graph: its ONNX model, the parameters (by name in the module it came from) that it reads besides
    its activation inputs, and the ONNX Runtime sessions that run it with the parameters bound, one per thread count.
    (``session_holding`` makes sessions that hold them as initializers instead.)"""

    def __init__(
        self,
        module: nn.Module,
        fn: Callable[..., Outputs],
        inputs: dict[str, torch.Tensor],
        outputs: list[str],
        free: dict[str, dict[int, str]] | None = None,
        opsets: dict[str, int] | None = None,
    ) -> None:
        """``fn(module, *inputs.values())`` -> ``outputs``, traced on ``inputs``. ``free``: the axes left free, by
        input or output name (default: the batch, axis 0, of every one). ``opsets``: the operator domains beyond
        ONNX's own that ``fn`` exports to, with their versions (the exporter warns, on stderr, of one unused)."""
        import onnx

        buffer = io.BytesIO()
        # Traced on one sequence: one row never takes WeightFormat's column blocks, so every product is exported as
        # a plain MatMul, and the batch is then left free (dynamic_axes).
        wrapper = _Method(module, fn)
        # The exporter traces in eval mode, then sets the wrapper's mode on everything under it: put each back.
        modes = {m: m.training for m in module.modules()}
        free = {name: {0: "batch"} for name in [*inputs, *outputs]} if free is None else free
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
                # Otherwise the exporter merges parameters that are equal when it traces (every norm weight of a
                # fresh model is 1.0) into one input, and the others are never read again.
                keep_initializers_as_inputs=True,
                custom_opsets=opsets,
                **_TRACED,
            )
        for m, training in modes.items():
            m.training = training
        self.onnx = buffer.getvalue()
        self.sessions: dict[int, object] = {}  # onnxruntime.InferenceSession by thread count, weights bound
        names = [i.name for i in onnx.load_from_string(self.onnx).graph.input]
        self.parameters = [name.removeprefix("m.") for name in names if name not in inputs]

    def _parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s parameters this graph reads, by their input names."""
        return {f"m.{name}": module.get_parameter(name).detach() for name in self.parameters}

    def session(self, threads: int):
        """An ONNX Runtime session of this graph on ``threads`` threads, made at first use, that reads its parameters
        from bindings (``bind``)."""
        if threads not in self.sessions:
            import onnxruntime

            self.sessions[threads] = onnxruntime.InferenceSession(
                self.onnx, _options(threads), providers=["CPUExecutionProvider"]
            )
        return self.sessions[threads]

    def session_holding(self, module: nn.Module, threads: int) -> tuple[object, list[object]]:
        """A new session of this graph on ``threads`` threads whose weights are ``module``'s parameters, as
        initializers read from the parameters' own memory, and what must outlive it: the parameters' tensors and the
        ONNX Runtime values over them.

        An initializer is a constant, so ONNX Runtime repacks each weight of a product into its own layout when it
        makes the session: a second copy of the matrices, which its products then stream faster than weights bound
        as inputs (a pass over cpu-small's weights at one thread: 6.5 against 7.7 ms; docs/cpu_performance.md,
        section L). The copy does not follow the parameters: a session holds the values they had when it was made."""
        import onnx
        import onnxruntime

        params = self._parameters(module)
        graph = onnx.load_from_string(self.onnx)
        inputs = [i for i in graph.graph.input if i.name not in params]
        del graph.graph.input[:]
        graph.graph.input.extend(inputs)
        for name, t in params.items():
            _address(t, name)
            # Declared as external data, which add_external_initializers then supplies from memory: no copy, and no
            # file is ever read.
            init = graph.graph.initializer.add(name=name, data_type=onnx.TensorProto.FLOAT, dims=list(t.shape))
            init.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", "in-memory"), ("offset", "0"), ("length", str(t.numel() * 4))):
                entry = init.external_data.add()
                entry.key, entry.value = key, value
        options = _options(threads)
        values = [onnxruntime.OrtValue.ortvalue_from_numpy(t.numpy()) for t in params.values()]
        options.add_external_initializers(list(params), values)
        session = onnxruntime.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session, [*params.values(), *values]

    def bind(
        self,
        module: nn.Module,
        activations: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
        threads: int = 1,
    ):
        """A binding of this graph's session on ``threads`` threads, by name and address, to ``activations``,
        ``module``'s parameters and ``outputs``. Returns the session, the binding and the tensors it reads from
        parameters."""
        session = self.session(threads)
        binding = session.io_binding()
        params = self._parameters(module)
        for name, t in (activations | params).items():
            bind_input(binding, name, t)
        for name, t in outputs.items():
            bind_output(binding, name, t)
        return session, binding, list(params.values())


def _options(threads: int):
    """ONNX Runtime's session options for ``threads`` threads: the caller's and ``threads - 1`` of its own, and no log
    lines. Its threads spin within a run and stop at its end (``session.force_spinning_stop``): left spinning after a
    run, they took the cores from PyTorch's OpenMP threads, and steps took up to twice as long
    (docs/cpu_performance.md, sections H and I)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.force_spinning_stop", "1")
    # Errors still raise; ONNX Runtime's own log lines would go to stderr, which zeroes a graded cell.
    options.log_severity_level = 4
    return options


# What a binding may point at: fp32 activations and weights, token ids, and GroupQueryAttention's int32 lengths.
_NUMPY = {torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64}


def bind_input(binding, name: str, t: torch.Tensor) -> None:
    """Bind the graph input ``name`` of ``binding`` (an ONNX Runtime IOBinding) to ``t``'s memory."""
    binding.bind_input(name, "cpu", 0, _NUMPY[t.dtype], list(t.shape), _address(t, name))


def bind_output(binding, name: str, t: torch.Tensor) -> None:
    """Bind the graph output ``name`` of ``binding`` to ``t``'s memory."""
    binding.bind_output(name, "cpu", 0, np.float32, list(t.shape), _address(t, name))


def _address(t: torch.Tensor, name: str) -> int:
    """``t``'s address, for a binding: ONNX Runtime reads it as contiguous fp32 (or int32) on the CPU, so anything
    else is refused (a device pointer or a strided view would be read as garbage, or crash the process)."""
    if t.device.type != "cpu" or t.dtype not in _NUMPY or not t.is_contiguous():
        layout = "contiguous" if t.is_contiguous() else "strided"
        raise ValueError(
            f"runtime: ONNX Runtime reads {name} from memory, but it is a {layout} {t.dtype} tensor on {t.device}; "
            "allowed: contiguous fp32 tensors on the CPU (or set model.runtime = 'eager')"
        )
    return t.data_ptr()


class _GroupQueryAttention(torch.autograd.Function):
    """ONNX Runtime's ``GroupQueryAttention`` (domain ``com.microsoft``) as the exporter sees it.

    One new token per sequence: ``q`` ``[B, 1, H * D]``, ``k``, ``v`` ``[B, 1, Hkv * D]`` (``q`` and ``k`` roped), over
    a layer's key and value slabs ``[B, Hkv, capacity, D]``, with the softmax scale ``scale``. It writes ``k`` and
    ``v`` into slot ``seqlens[b]`` of each sequence and attends over slots ``0 .. seqlens[b]`` (``total`` = the
    longest, plus one). Its present outputs are bound to the same memory as the slabs, so it writes in place and reads
    no slot past the length. Query head ``h`` reads KV head ``h // (H / Hkv)``, as
    ``kvlab.model.attention.group_queries`` groups them. Only ever traced: PyTorch runs ``forward`` for the shapes,
    ONNX Runtime runs the operator.
    """

    @staticmethod
    def forward(ctx, q, k, v, keys, values, seqlens, total, n_heads: int, n_kv_heads: int, scale: float):  # noqa: ARG004
        return torch.zeros_like(q), keys.clone(), values.clone()

    @staticmethod
    def symbolic(g, q, k, v, keys, values, seqlens, total, n_heads: int, n_kv_heads: int, scale: float):
        outputs = g.op(
            "com.microsoft::GroupQueryAttention",
            *(q, k, v, keys, values, seqlens, total),
            num_heads_i=n_heads,
            kv_num_heads_i=n_kv_heads,
            scale_f=scale,
            outputs=3,
        )
        for out, like in zip(outputs, (q, keys, values), strict=True):
            out.setType(like.type())
        return outputs


class _SimplifiedLayerNorm(torch.autograd.Function):
    """``RMSNorm`` as ONNX Runtime's ``SimplifiedLayerNormalization``: ``x / sqrt(mean(x**2) + eps) * weight`` over
    the last axis, in fp32. One operator where the traced module is six."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):  # noqa: ARG004
        return F.rms_norm(x, weight.shape, weight, eps)

    @staticmethod
    def symbolic(g, x, weight, eps: float):
        out = g.op("SimplifiedLayerNormalization", x, weight, axis_i=-1, epsilon_f=eps, stash_type_i=1)
        out.setType(x.type())
        return out


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for the whole-step graph: one ``SimplifiedLayerNormalization`` for kvlab's ``RMSNorm``, the module
    itself, traced, for any other."""
    return _SimplifiedLayerNorm.apply(x, norm.weight, norm.eps) if type(norm) is RMSNorm else norm(x)


def _whole_step(model: nn.Module, tokens, seqlens, inv_freq, sign, *slabs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The decode step of ``tokens`` ``[B, 1]`` at positions ``seqlens`` ``[B]``, every layer and the head, attention
    through ``_GroupQueryAttention`` on ``slabs`` (each layer's keys, then values) -> the logits, then each slab as
    written. The embedding and RoPE's angles (from the model's ``inv_freq`` and ``sign``, bound like its weights) are
    in the graph too, so a step runs no PyTorch operation around it.

    ``Attention.project`` and ``output`` are written out for one token, every size but the batch a constant; the
    MLP and the head are the model's own modules; each ``RMSNorm`` is one ``_SimplifiedLayerNorm``. The traced
    ``Block`` halves read their sizes from their input, which a free batch axis leaves to the graph to compute at
    every step: 580 operators a step on cpu-small, against 189 (docs/cpu_performance.md, section P)."""
    cfg, written = model.cfg, []
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    total = seqlens.max() + 1
    cos, sin = rope_angles(seqlens.long()[:, None], inv_freq, sign)  # [B, 1, 1, D]
    x = model.embed(tokens)
    for block, keys, values in zip(model.layers, slabs[::2], slabs[1::2], strict=True):
        attn = block.attn
        qkv = attn.weights.matmul(_norm(block.attn_norm, x), attn.wqkv)  # [B, 1, (H + 2 Hkv) * D]: q | k | v
        qk, v = qkv.split([(h + hkv) * d, hkv * d], -1)
        qk = apply_rope(qk.view(-1, 1, h + hkv, d), cos, sin).view(-1, 1, (h + hkv) * d)
        q, k = qk.split([h * d, hkv * d], -1)
        attended, keys, values = _GroupQueryAttention.apply(q, k, v, keys, values, seqlens, total, h, hkv, attn.scale)
        x = x + attn.weights.matmul(attended, attn.wo)
        x = x + block.mlp(_norm(block.mlp_norm, x))
        written += [keys, values]
    return model._logits(x), *written


def one_graph_covers(cfg) -> bool:
    """Whether a decode step of a model built from ``cfg`` can run as one graph: ONNX Runtime's CPU
    ``GroupQueryAttention`` takes head dims that are multiples of 8, and no sliding-window layer."""
    return cfg.head_dim % 8 == 0 and not any(cfg.layer_windows or ())


class _Plan:
    """The buffers and bindings of a step at one batch size, on a cache that attends by itself: built once, reused by
    every step at that size. Per layer, a graph before attention and one after it."""

    def __init__(self, step: OnnxStep, batch: int) -> None:
        model, cfg = step.model, step.model.cfg
        h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # The residual stream alternates between two buffers, so that no graph writes the tensor it reads.
        self.stream = [torch.zeros(batch, 1, cfg.d_model), torch.zeros(batch, 1, cfg.d_model)]
        self.x = self.stream[0]
        self.cos, self.sin = torch.zeros(batch, 1, 1, d), torch.zeros(batch, 1, 1, d)
        self.q, self.attended = torch.zeros(batch, hkv, h // hkv, 1, d), torch.zeros(batch, hkv, h // hkv, 1, d)
        self.k, self.v = torch.zeros(batch, 1, hkv, d), torch.zeros(batch, 1, hkv, d)
        self.logits_shape = (batch, 1, cfg.vocab_size)
        # A binding holds addresses only: ``self.weights`` holds the tensors they point into, so that their memory
        # outlives the binding even if the model lets go of it (``.data =``, ``load_state_dict(assign=True)``).
        # Each graph on one thread, the caller's: PyTorch's threads run the attention between them.
        self.layers, self.weights = [], []
        for i, block in enumerate(model.layers):
            x, y = self.stream[i % 2], self.stream[(i + 1) % 2]
            *before, w1 = step.before.bind(
                block, {"x": x, "cos": self.cos, "sin": self.sin}, {"q": self.q, "k": self.k, "v": self.v}
            )
            *after, w2 = step.after.bind(block, {"x": x, "attended": self.attended}, {"y": y})
            self.layers.append((block, before, after))
            self.weights += w1 + w2
        last = self.stream[len(model.layers) % 2]
        *self.head, w3 = step.head.bind(model, {"x": last}, {"logits": torch.empty(self.logits_shape)})
        self.weights += w3

    def run(self, step: OnnxStep, tokens: torch.Tensor, cache: KVCache, logits: torch.Tensor) -> None:
        """One step of ``tokens``: the graphs, each layer's attention on ``cache`` between them, into ``logits``."""
        model = step.model
        cos, sin = model.angles(cache.reserve(1), 1)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.x.copy_(model.embed(tokens))
        for block, (before, before_binding), (after, after_binding) in self.layers:
            before.run_with_iobinding(before_binding)
            self.attended.copy_(block.attn.attend(self.q, self.k, self.v, model.rope, cache))
            after.run_with_iobinding(after_binding)
        head, binding = self.head
        bind_output(binding, "logits", logits)
        head.run_with_iobinding(binding)


class _WholePlan:
    """The buffers and binding of the whole-step graph at one batch size, on a cache it reads in place
    (``OnnxStep._reads_in_place``), on ``threads`` threads. A cache's slabs are bound at its first step, and again
    for another cache."""

    def __init__(self, step: OnnxStep, batch: int, threads: int) -> None:
        model = step.model
        self.tokens, self.seqlens = torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, dtype=torch.int32)
        self.logits_shape = (batch, 1, model.cfg.vocab_size)
        rope = model.rope
        activations = {"tokens": self.tokens, "seqlens": self.seqlens, "inv_freq": rope.inv_freq, "sign": rope.sign}
        if step.watch.versioned:
            if threads not in step.whole_sessions:
                step.whole_sessions[threads] = step.whole.session_holding(model, threads)
            self.session, self.weights = step.whole_sessions[threads]
            self.binding = self.session.io_binding()
            for name, t in activations.items():
                bind_input(self.binding, name, t)
        else:  # bound: read as they are
            self.session, self.binding, self.weights = step.whole.bind(model, activations, {}, threads)
        self.weights = [*self.weights, rope.inv_freq, rope.sign]
        self.cache: weakref.ref[KVCache] | None = None  # the cache whose slabs are bound

    def run(self, step: OnnxStep, tokens: torch.Tensor, cache: ContiguousKVCache, logits: torch.Tensor) -> None:
        """One step of ``tokens`` in one graph, writing their K/V into ``cache``'s next slot, into ``logits``.

        Nothing but the graph runs between two steps' weight reads: PyTorch code run in between found its own code
        and data evicted by the weights' stream, and took about 0.5 ms a step where it took 0.1 in a loop of its own
        (docs/cpu_performance.md, section I)."""
        if self.cache is None or self.cache() is not cache:
            self.cache = None  # all of a cache's slabs are bound, or none is used
            for layer in range(cache.shape.n_layers):
                for name, slab in zip(_slab_names(layer), cache.slabs(layer), strict=True):
                    bind_input(self.binding, name, slab)
                    bind_output(self.binding, f"{name}.written", slab)
            self.cache = weakref.ref(cache)
        start = cache.reserve(1)
        self.seqlens.fill_(start)  # the slot each sequence's new token takes: its position
        self.tokens.copy_(tokens)
        bind_output(self.binding, "logits", logits)
        try:
            self.session.run_with_iobinding(self.binding)
        except Exception:
            cache.truncate(start)  # the step did not happen: its slot is not the cache's
            raise


def _slab_names(layer: int) -> tuple[str, str]:
    return f"keys.{layer}", f"values.{layer}"


class OnnxStep:
    """``model``'s decode step with its dense parts in ONNX Runtime (see the module docstring). ``step(tokens [B, 1],
    cache)`` -> logits ``[B, vocab]``, as ``Decoder.decode_step``.

    Each graph is exported at the first step that needs it: the whole step (about 1 s on cpu-small) on a cache that
    ``_reads_in_place``, where ONNX Runtime's ``GroupQueryAttention`` writes and reads the cache's slabs where they
    are; the two halves of a layer and the head (about 0.5 s) on any other cache, around the cache's own attention.

    Each batch size gets its buffers and bindings at its first step; all are bound again, and the whole-step graph's
    sessions made again, when a parameter moved to new memory (``.data =``), under onnx-packed when one changed in
    place (its version: a ``load_state_dict``), or when any module registered a new parameter or submodule
    (``load_state_dict(assign=True)``, a replaced layer or RoPE). Steps run one at a time: a lock serialises threads
    that share the model, since every step at one batch size writes the same buffers.
    """

    checks_ids = False  # Decoder.decode_step checks the token ids before a step

    def __init__(self, model: nn.Module, packed: bool = False) -> None:
        self.packed = packed
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"runtime: {self.runtime!r} for {reason}")
        self.model = model
        self.watch = ParameterWatch(model, copies=packed)
        # The whole-step graph writes out kvlab's own Attention (_whole_step): a layer whose attention is another
        # module keeps the split graphs, which trace it. Asked once: a module replaced later takes a new runtime.
        self.one_graph = one_graph_covers(model.cfg) and all(type(block.attn) is Attention for block in model.layers)
        self.lock = threading.Lock()
        self._forget_plans()

    @property
    def runtime(self) -> str:
        """``Decoder.runtime``'s name for this step: ``"onnx-packed"`` or ``"onnx"``."""
        return "onnx-packed" if self.packed else "onnx"

    # Each graph is exported from the model's own modules at its first use.
    @functools.cached_property
    def before(self) -> _Graph:
        x, cos, sin = self._examples()
        block = self.model.layers[0]
        return self._export(block, type(block).before_attention, {"x": x, "cos": cos, "sin": sin}, ["q", "k", "v"])

    @functools.cached_property
    def after(self) -> _Graph:
        x, cos, sin = self._examples()
        block = self.model.layers[0]
        with torch.no_grad():
            attended = torch.zeros_like(block.before_attention(x, cos, sin)[0])
        return self._export(block, type(block).after_attention, {"x": x, "attended": attended}, ["y"])

    @functools.cached_property
    def head(self) -> _Graph:
        return self._export(self.model, type(self.model)._logits, {"x": self._examples()[0]}, ["logits"])

    @functools.cached_property
    def whole(self) -> _Graph:
        model, cfg = self.model, self.model.cfg
        inputs = {
            "tokens": torch.zeros(1, 1, dtype=torch.long),
            "seqlens": torch.zeros(1, dtype=torch.int32),
            "inv_freq": model.rope.inv_freq.clone(),
            "sign": model.rope.sign.clone(),
        }
        slabs = {
            n: torch.zeros(1, cfg.n_kv_heads, 2, cfg.head_dim) for i in range(cfg.n_layers) for n in _slab_names(i)
        }
        outputs = ["logits", *(f"{n}.written" for n in slabs)]
        free = {n: {0: "batch"} for n in ["tokens", "seqlens", "logits"]}
        free |= {n: {0: "batch", 2: "capacity"} for n in [*outputs[1:], *slabs]}
        return self._export(model, _whole_step, inputs | slabs, outputs, free, {"com.microsoft": 1})

    def _examples(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Example residual stream, cos and sin for a trace: distinct tensors, since the tracer tells inputs apart by
        identity."""
        cfg = self.model.cfg
        return torch.zeros(1, 1, cfg.d_model), torch.ones(1, 1, 1, cfg.head_dim), torch.zeros(1, 1, 1, cfg.head_dim)

    def _export(self, *args) -> _Graph:
        """``_Graph(*args)``, traced without autograd."""
        with torch.no_grad():
            graph = _Graph(*args)
        # The export wraps the module in one of its own, which counts as a registration: not a change to the model.
        self.watch.ignore_registrations()
        return graph

    def _forget_plans(self) -> None:
        self.plans: dict[tuple[int, int], _Plan | _WholePlan] = {}  # by batch and threads (0: the split graphs)
        # The whole-step graph's sessions by thread count, each holding the weights' values when it was made.
        self.whole_sessions: dict[int, tuple[object, list[object]]] = {}
        # Under onnx-packed the whole-step graph's sessions hold the weights' values, so an edit in place
        # (load_state_dict, an optimizer's step), which bumps a tensor's version, must make them anew. A tensor made
        # under inference mode has no version (``watch.versioned`` is False): then the graph binds the weights, as
        # under onnx, and reads them live.
        self.watch.reset()

    def _reads_in_place(self, cache: KVCache) -> bool:
        """Whether a step on ``cache`` runs as one graph, attention included: a ``ContiguousKVCache`` of fp32 with keys
        token-major (``key_major=False``, what ``Decoder.new_cache`` makes under ``runtime="onnx"`` where
        ``one_graph_covers`` the model). On every other cache, the cache's own attention runs between the graphs."""
        return self.one_graph and type(cache) is ContiguousKVCache and not cache.key_major and cache.codec == "fp32"

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        model = self.model
        with self.lock:
            if self.watch.stale():
                reason = model_problem(model)
                if reason is not None:  # the model was moved or cast after it was built
                    raise ValueError(f"runtime: {self.runtime!r} for {reason}")
                self._forget_plans()
            # The whole-step graph runs on as many threads as PyTorch has now; the split graphs on one.
            batch, threads = tokens.shape[0], torch.get_num_threads() if self._reads_in_place(cache) else 0
            plan = self.plans.get((batch, threads))
            if plan is None:
                for name, p in model.named_parameters():  # before an export that would trace them
                    _address(p, name)
                plan = _WholePlan(self, batch, threads) if threads else _Plan(self, batch)
                self.plans[batch, threads] = plan
            # Fresh logits at every step, as the eager step returns: a caller may keep them.
            logits = torch.empty(plan.logits_shape)
            plan.run(self, tokens, cache, logits)
            return logits[:, 0]
