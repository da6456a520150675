"""The decode step as one flat module, three ways, for ``benchmarks/weight_term.py``: measuring instruments, not kvlab.

- ``FlatStep``: the model's step with every abstraction taken out, in eager PyTorch: the floor of what PyTorch's cost
  per call allows.
- ``onnx_step``: that module exported to ONNX and run whole by ONNX Runtime (K/V as inputs, new rows as outputs): the
  ceiling of a step with no Python in it, and no cache either.
- ``openvino_step``: the same graph compiled by OpenVINO, whose kernels are another runtime's.

kvlab's own ONNX Runtime step, which keeps every cache, is ``Decoder(cfg, runtime="onnx")`` (``kvlab.model.onnx_step``).
``check_step`` holds each instrument to the model's logits (``tests/test_flat_step.py``). ONNX Runtime and ``onnx``
come with ``pip install -e .[onnx]``, OpenVINO with ``.[openvino]``; without them ``onnx_step`` and ``openvino_step``
return None. Measurements: docs/cpu_performance.md, sections G, H and O.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvlab import Decoder


def floor_covers(model: Decoder) -> bool:
    """Whether ``FlatStep`` can write ``model``'s step: a dense fp32 model with global attention."""
    cfg = model.cfg
    return (
        cfg.mla is None
        and cfg.moe is None
        and not any(cfg.layer_windows or ())
        and model.weight_dtype == "fp32"
        and model.torch_dtype == torch.float32
    )


class FlatStep(torch.nn.Module):
    """``model``'s decode step as one flat module, a measuring instrument: about as few PyTorch calls as eager mode
    allows (the eager floor), and a graph ONNX Runtime can run (``onnx_step``). ``check_step`` holds either to the
    model's logits.

    ``forward(token [1], cos [1, D], sin [1, D], keys [L, Hkv, D, n], values [L, Hkv, n, D])`` -> ``(logits [V],
    new keys [L, Hkv, D], new values [L, Hkv, D])``: the step at position ``n`` (``cos``, ``sin``: RoPE's angles
    there) over a cache of ``n`` tokens (keys key-major), which the caller extends with the new rows. The same
    arithmetic as ``Decoder.decode_step`` with every abstraction taken out: weights fetched once, no module calls
    inside, no cache object, no input checks. The products are the model's own (``WeightFormat.matmul``), so the
    eager floor changes kernels with the thread count as the model does. Only for a model ``floor_covers``.
    """

    def __init__(self, model: Decoder) -> None:
        if not floor_covers(model):
            raise ValueError(
                f"model: {model.cfg.name}; allowed: a dense fp32 model with global attention (floor_covers)"
            )
        super().__init__()
        cfg = model.cfg
        self.h, self.hkv, self.d, self.width = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        self.layers = [
            [t.detach() for t in (b.attn_norm.weight, b.attn.wqkv, b.attn.wo, b.mlp_norm.weight, b.mlp.w_gate_up)]
            + [b.mlp.w_down.detach()]
            for b in model.layers
        ]
        self.embed, self.final_norm = model.embed.weight.detach(), model.norm.weight.detach()
        self.head = self.embed.T if model.lm_head is None else model.lm_head.detach()
        self.eps, self.mm = torch.tensor(cfg.norm_eps), model.weights.matmul

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        length = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x * torch.addcmul(self.eps, length, length, value=1 / self.width).rsqrt() * weight

    def forward(
        self, token: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed[token].view(1, self.width)
        new_keys, new_values = [], []
        for (attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down), k, v in zip(self.layers, keys, values, strict=True):
            q, k_new, v_new = self.before_attention(x, attn_norm, wqkv, cos, sin)
            new_keys.append(k_new)
            new_values.append(v_new)
            k, v = torch.cat([k, k_new[..., None]], -1), torch.cat([v, v_new[:, None]], -2)
            out = torch.matmul(torch.softmax(torch.matmul(q, k), -1), v)
            x = self.after_attention(x, out.view(1, -1), wo, mlp_norm, w_gate_up, w_down)
        return self.logits(x, self.final_norm, self.head)[0], torch.stack(new_keys), torch.stack(new_values)

    def before_attention(
        self, x: torch.Tensor, attn_norm: torch.Tensor, wqkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[1, d_model]`` -> the scaled queries grouped by KV head ``[Hkv, G, D]``, the key ``[Hkv, D]`` (both
        roped) and the value ``[Hkv, D]``."""
        h, hkv, d = self.h, self.hkv, self.d
        qkv = self.mm(self.norm(x, attn_norm), wqkv).view(h + 2 * hkv, d)
        qk = torch.addcmul(qkv[: h + hkv] * cos, qkv[: h + hkv].roll(d // 2, -1), sin)
        return (qk[:h] * d**-0.5).view(hkv, h // hkv, d), qk[h:], qkv[h + hkv :]

    def after_attention(
        self,
        x: torch.Tensor,
        attended: torch.Tensor,
        wo: torch.Tensor,
        mlp_norm: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor:
        """The residual stream ``x`` ``[1, d_model]`` after the attention's output ``attended`` ``[1, H * D]`` and the
        MLP."""
        x = x + self.mm(attended, wo)
        gate, up = self.mm(self.norm(x, mlp_norm), w_gate_up).chunk(2, -1)
        return x + self.mm(F.silu(gate) * up, w_down)

    def logits(self, x: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return self.mm(self.norm(x, final_norm), head)

    def empty_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of a cache holding no token: ``[L, Hkv, D, 0]``, ``[L, Hkv, 0, D]``."""
        n = len(self.layers)
        return torch.zeros(n, self.hkv, self.d, 0), torch.zeros(n, self.hkv, 0, self.d)


Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def check_step(model: Decoder, tokens: list[int], step: Step | None = None) -> float:
    """Feed ``tokens`` one at a time, at positions 0, 1, 2, ..., to the model and to ``step`` (default: a
    ``FlatStep``), keeping ``step``'s cache here; the largest logit difference.

    Raises if any logit differs by more than 1e-4: a step is timed in the model's place only if it computes it (on
    the same kernels the two agree exactly).
    """
    flat = FlatStep(model)
    step = flat if step is None else step
    keys, values = flat.empty_cache()
    cos, sin = model.rope.span(0, len(tokens))  # [n, 1, D]
    cache = model.new_cache(1, len(tokens))
    worst = 0.0
    for position, t in enumerate(tokens):
        want = model.decode_step(torch.tensor([t]), cache)[0]
        got, new_keys, new_values = step(torch.tensor([t]), cos[position], sin[position], keys, values)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        worst = max(worst, (got - want).abs().max().item())
        keys, values = torch.cat([keys, new_keys[..., None]], -1), torch.cat([values, new_values[:, :, None]], -2)
    return worst


def _export(flat: FlatStep, path: str) -> list[str]:
    """Write ``flat`` to ``path`` as an ONNX graph whose cache grows along the token axis; its input names."""
    keys, values = flat.empty_cache()
    example = (torch.zeros(1, dtype=torch.long), torch.ones(1, flat.d), torch.zeros(1, flat.d), keys, values)
    names = ["token", "cos", "sin", "keys", "values"]
    dynamic = {"keys": {3: "tokens"}, "values": {2: "tokens"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript-based exporter is deprecated; it still traces this graph
        outputs = ["logits", "new_keys", "new_values"]
        torch.onnx.export(
            flat, example, path, dynamo=False, input_names=names, output_names=outputs, dynamic_axes=dynamic
        )
    return names


def onnx_step(flat: FlatStep, threads: int) -> Step | None:
    """``flat`` exported to ONNX and run by ONNX Runtime on ``threads`` threads, with ``FlatStep``'s signature; None
    without ``onnxruntime`` and ``onnx``. ONNX Runtime runs the graph from C++, so a step pays no Python per operation.
    Its threads spin between runs, fastest when nothing else runs in between (``weight_term.py`` times it alone)."""
    try:
        import onnx  # noqa: F401 (the exporter writes through it)
        import onnxruntime
    except ImportError:
        print("onnxruntime candidates skipped: pip install -e .[onnx] (onnx, onnxruntime)")
        return None
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.onnx")
        names = _export(flat, path)
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def step(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = session.run(None, {name: x.numpy() for name, x in zip(names, inputs, strict=True)})
        return tuple(torch.from_numpy(o) for o in outputs)

    return step


def openvino_step(flat: FlatStep, threads: int) -> Step | None:
    """The graph ``onnx_step`` runs, compiled by OpenVINO's CPU plugin on ``threads`` threads instead, with
    ``FlatStep``'s signature; None without ``openvino`` and ``onnx``. The same graph on another runtime's kernels:
    OpenVINO repacks the weights for its own, which read them faster than ONNX Runtime's on the AMD machine
    (docs/cpu_performance.md, section O).

    Its precision is pinned to fp32: on a CPU with bf16 instructions (AVX512-BF16, AMX) OpenVINO's default
    (``INFERENCE_PRECISION_HINT``) is bf16: its products would no longer be the model's fp32 ones, nor its logits."""
    try:
        import onnx  # noqa: F401 (the exporter writes through it)
        import openvino
    except ImportError:
        print("openvino candidate skipped: pip install -e .[openvino] (onnx, openvino)")
        return None
    config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.onnx")
        _export(flat, path)
        core = openvino.Core()
        request = core.compile_model(core.read_model(path), "CPU", config).create_infer_request()

    def step(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = request.infer([x.numpy() for x in inputs], share_inputs=True)
        return tuple(torch.from_numpy(o) for o in outputs.to_tuple())

    return step
