"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU) whose decode step is laid out to stream its bytes.

The weights of every projection are stored ``[in, out]`` and applied through ``kvlab.model.weights.WeightFormat``: in
fp32, ``x @ W``, which for the one-row activations of a decode step reads each weight row contiguously (on a
2-core AMD EPYC as fast as summing the same tensors, where ``F.linear`` on ``[out, in]`` weights was about 0.7 of
it: docs/cpu_performance.md); ``weight_dtype="int8"`` reads a quarter of the bytes through PyTorch's quantized
kernels, and ``"fp16"`` half of them through fbgemm's fp16 kernel on x86 CPUs. Q, K and V share one matrix and so do
SwiGLU's gate and up projections, so a layer is four matrix products and few Python calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from kvlab.cache.base import CacheShape, KVCache
from kvlab.cache.policy.window import WindowKVCache
from kvlab.cache.storage.latent import LatentKVCache
from kvlab.cache.storage.slab import ContiguousKVCache
from kvlab.machine.device import resolve_device
from kvlab.model.attention import Attention
from kvlab.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from kvlab.model.mla import MLAAttention
from kvlab.model.numba_step import NumbaStep
from kvlab.model.onnx_step import OnnxStep
from kvlab.model.runtimes import ONNX_RUNTIMES, RUNTIMES
from kvlab.model.weights import WEIGHT_DTYPES, WeightFormat
from kvlab.spec.config import ModelConfig
from kvlab.spec.dtypes import KV_DTYPES, canonical_dtype, to_torch


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, weights: WeightFormat) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer, weights) if cfg.mla is None else MLAAttention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, weights)

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        return self.feed_forward(x + self.attn(self.attn_norm(x), rope, cos, sin, cache))

    # The block split at attention, for a runtime that runs the dense parts elsewhere (kvlab.model.onnx_step) and
    # leaves attention to the cache. MHA/GQA/MQA only.
    def before_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream ``x`` -> ``Attention.project``'s queries, keys and values."""
        return self.attn.project(self.attn_norm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream ``x`` and ``Attention.attend``'s output -> the stream after the whole block."""
        return self.feed_forward(x + self.attn.output(attended))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token ids in, next-token logits out, with a KV cache between calls.

    - ``forward(tokens)``: the whole sequence, no cache (a fresh one is used and dropped).
    - ``prefill(tokens, cache)``, ``decode_step(tokens, cache)``: logits for the new positions only.
    - ``generate(prompt, max_new_tokens)``: greedy or sampled continuation, new ids only.

    ``weight_dtype`` (``kvlab.model.weights.WEIGHT_DTYPES``, default fp32) is the precision the projections and the LM
    head read their weights in; the parameters themselves stay fp32 (``kvlab.model.weights``). With another precision,
    ``cfg`` records it in ``weight_dtypes``, so the byte model (``kvlab.roofline``) charges those bytes.
    ``runtime`` (``kvlab.model.runtimes.RUNTIMES``: ``"eager"``, ``"onnx"``, ``"onnx-packed"`` or ``"numba"``) is what
    runs ``decode_step``: see the ``runtime`` property.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        device: str | torch.device | None = None,
        seed: int | None = 0,
        weight_dtype: str = "fp32",
        runtime: str = "eager",
    ) -> None:
        super().__init__()
        if not cfg.runnable:
            raise ValueError(f"{cfg.name}: {cfg.not_runnable_reason}")
        weight_dtype = canonical_dtype(weight_dtype, "weight_dtype", WEIGHT_DTYPES)
        if weight_dtype == "int8" and resolve_device(device).type != "cpu":
            raise ValueError(
                f"weight_dtype: 'int8' on {resolve_device(device)}; allowed: int8 on the CPU (PyTorch's quantized "
                "linear is a CPU kernel), or fp32, bf16, fp16 on any device"
            )
        if weight_dtype != "fp32":
            if cfg.mla is not None:
                raise ValueError(f"weight_dtype: {weight_dtype!r} with MLA; allowed: 'fp32' (MLA's weights are fp32)")
            cfg = cfg.replace(weight_dtypes=(("embeddings", weight_dtype), ("other", weight_dtype)))
        self.cfg = cfg
        self.weights = WeightFormat(weight_dtype, resolve_device(device))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i, self.weights) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.d_model, cfg.vocab_size))
        rope_dim = cfg.head_dim if cfg.mla is None else cfg.mla.qk_rope_head_dim  # MLA ropes only that part
        self.rope = RotaryEmbedding(rope_dim, cfg.rope_theta, dict(cfg.rope_scaling or ()))
        self.reset_parameters(seed)
        self.to(device=resolve_device(device), dtype=to_torch(cfg.dtype))
        # RoPE angles stay fp32 even in a bf16 model: bf16 cannot tell position 300 from 301.
        self.rope.inv_freq = self.rope.inv_freq.float()
        self.eval()
        self._compiled_step: OnnxStep | NumbaStep | None = None
        self.runtime = runtime
        self._accepted: tuple | None = None  # (cache shape, weight dtype, device) the last cache check passed

    @property
    def runtime(self) -> str:
        """What runs ``decode_step``: ``"eager"`` (PyTorch, every model and device), ``"onnx"`` (ONNX Runtime: the
        whole step as one graph on the cache ``new_cache`` makes, the dense parts around the cache's own attention on
        any other; ``kvlab.model.onnx_step``), ``"onnx-packed"`` (the same, with the whole-step graph holding a
        copy of the weights repacked for ONNX Runtime's products: faster, more memory, and blind to writes through
        ``.data``), or ``"numba"`` (the whole step as one function compiled by numba, on one thread, reading a
        transposed copy of the weights, on the cache ``new_cache`` makes; the eager step on any other:
        ``kvlab.model.numba_step``). Settable, e.g. after loading a checkpoint."""
        return "eager" if self._compiled_step is None else self._compiled_step.runtime

    @runtime.setter
    def runtime(self, runtime: str) -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime: {runtime!r}; allowed: {', '.join(map(repr, RUNTIMES))}")
        if runtime in ONNX_RUNTIMES:
            self._compiled_step = OnnxStep(self, packed=runtime == "onnx-packed")
        else:
            self._compiled_step = NumbaStep(self) if runtime == "numba" else None

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = 0) -> None:
        """Random weights: N(0, 0.02), with the residual projections scaled down by depth as in GPT-2."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std, out_std = 0.02, 0.02 / (2 * self.cfg.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (out_std if name.endswith(("wo", "w_down")) else std))

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def weight_dtype(self) -> str:
        return self.weights.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, batch_size: int = 1, capacity: int | None = None, kv_dtype: str | None = None) -> KVCache:
        """A cache for this model's own shape; ``capacity`` defaults to ``max_seq_len``.

        ``kv_dtype`` (default: the model's dtype) is the codec, any of ``kvlab.spec.dtypes.KV_DTYPES``. The storage
        follows the model: MLA's latent slab for an MLA model; a window cache when some layers are local (they
        keep only their window, the global ones everything); a contiguous slab otherwise, its keys token-major under
        ``runtime="onnx"`` in fp32 where one graph covers the model (``OnnxStep.one_graph``): the layout whose
        decode step runs as one graph.
        """
        cfg = self.cfg
        capacity = cfg.max_seq_len if capacity is None else capacity
        codec = canonical_dtype(kv_dtype or cfg.dtype, "kv_dtype", KV_DTYPES)
        local = cfg.layer_windows is not None and any(w is not None for w in cfg.layer_windows)
        if cfg.mla is not None and local:
            raise ValueError(
                f"{cfg.name}: MLA with sliding-window layers has no cache in kvlab; supported: MLA with global "
                "layers (LatentKVCache), or MHA/GQA/MQA with sliding-window layers (WindowKVCache)"
            )
        if cfg.mla is not None:
            return LatentKVCache.for_model(self, batch_size, capacity, codec=codec)
        if local:
            return WindowKVCache.for_model(self, batch_size, capacity, window=cfg.layer_windows, codec=codec)
        # The step decided once whether one graph covers this model (its config and its attention modules).
        step = self._compiled_step
        one_graph = isinstance(step, OnnxStep) and step.one_graph and codec == "fp32"
        return ContiguousKVCache.for_model(self, batch_size, capacity, codec=codec, key_major=not one_graph)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return self.weights.matmul(h, self.embed.weight.T if self.lm_head is None else self.lm_head)

    def _run(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        tokens = self._check_tokens(torch.as_tensor(tokens, device=self.device), cache)
        n = tokens.shape[1]
        cos, sin = self.angles(0 if cache is None else cache.reserve(n), n)
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h, self.rope, cos, sin, cache)
        return self._logits(h)

    def angles(self, start: int | torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``cos``, ``sin`` for ``n`` new tokens from ``start`` (``KVCache.reserve``'s answer), in the model's
        dtype: ``[n, 1, D]`` for one start, ``[B, n, 1, D]`` for one start per sequence."""
        if isinstance(start, int):
            cos, sin = self.rope.span(start, n)
        else:
            # A ragged batch (sequences at different lengths, as continuous batching runs them) gets one start per
            # sequence from its cache: positions [B, T], so each sequence's tokens are roped at their own positions.
            cos, sin = self.rope(start.to(self.device)[:, None] + torch.arange(n, device=self.device))
        return cos.to(self.torch_dtype), sin.to(self.torch_dtype)

    def _check_tokens(self, tokens: torch.Tensor, cache: KVCache | None, ids: bool = True) -> torch.Tensor:
        """``tokens`` (a tensor on the model's device), refused unless ``[B, T]`` ids in the vocabulary (unless not
        ``ids``: a step that checks them itself), B the cache's."""
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens: shape {tuple(tokens.shape)}; allowed: [batch, time] with time >= 1")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            # ONNX Runtime's embedding would take 1.7 as token 1
            raise ValueError(f"tokens: dtype {tokens.dtype}; allowed: integer token ids")
        if cache is not None:
            self._check_cache(cache)
            if tokens.shape[0] != cache.batch_size:
                raise ValueError(f"tokens: batch {tokens.shape[0]} but the cache holds {cache.batch_size} sequences")
        if ids and tokens.device.type == "cpu":  # on a GPU, reading min/max back would stall its queue every step
            self._check_ids(tokens)
        return tokens

    def _check_ids(self, tokens: torch.Tensor) -> None:
        lo, hi = (int(t) for t in torch.aminmax(tokens))
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"tokens: ids {lo}..{hi}; allowed: 0 <= id < vocab_size={self.cfg.vocab_size}")

    def _check_cache(self, cache: KVCache) -> None:
        """Refuse, naming what differs, a cache shaped for another model (another model's ``new_cache``), or for
        this one before a cast or a move. Torch's own error would come from deep inside attention, or never: a cache
        with more layers than the model runs. Runs at every step, so the shape last accepted passes at once."""
        shape, weight = getattr(cache, "shape", None), self.embed.weight
        if not isinstance(shape, CacheShape) or (shape, weight.dtype, weight.device) == self._accepted:
            return
        if weight.dtype != to_torch(self.cfg.dtype):
            wanted = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(weight.dtype, "fp32")
            raise ValueError(
                f"model: its parameters are {weight.dtype}, but cfg.dtype is {self.cfg.dtype!r}: a Decoder is not "
                "cast once built, since its caches and byte counts follow cfg.dtype; allowed: a model built in the "
                f"dtype, new = Decoder(model.cfg.replace(dtype={wanted!r})), then "
                "new.load_state_dict(model.state_dict())"
            )
        own = CacheShape.from_config(self.cfg, self.device)
        fields = [
            f
            for f in ("n_layers", "n_kv_heads", "head_dim", "latent_values", "dtype")
            if getattr(shape, f) != getattr(own, f)
        ]
        theirs, ours = torch.device(shape.device), self.device
        if theirs.type != ours.type or theirs.index not in (None, ours.index):
            fields.append("device")
        if fields:
            raise ValueError(
                "cache: "
                + ", ".join(f"{f}={getattr(shape, f)!r}" for f in fields)
                + ", but the model has "
                + ", ".join(f"{f}={getattr(own, f)!r}" for f in fields)
                + "; allowed: a cache of this model's shape (model.new_cache)"
            )
        self._accepted = (shape, weight.dtype, weight.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: ``[B, T]`` -> logits ``[B, T, V]`` for every position, no cache. Differentiable (training)."""
        if tokens.shape[-1] > self.cfg.max_seq_len:
            raise ValueError(
                f"tokens: {tokens.shape[-1]} positions; allowed: at most max_seq_len={self.cfg.max_seq_len}"
            )
        return self._run(tokens, None)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append ``tokens`` ``[B, T]`` to ``cache``; logits ``[B, T, V]`` for those positions."""
        return self._run(tokens, cache)

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token per sequence, ``[B]`` or ``[B, 1]`` -> logits ``[B, V]``."""
        tokens = torch.as_tensor(tokens, device=self.device)
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        if tokens.shape[-1] != 1:
            raise ValueError(f"tokens: decode_step takes one token per sequence; got shape {tuple(tokens.shape)}")
        step = self._compiled_step
        if step is not None and cache is not None:
            return step(self._check_tokens(tokens, cache, ids=not step.checks_ids), cache)
        return self._run(tokens, cache)[:, -1]

    @torch.inference_mode()
    def generate(
        self,
        prompt: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Continue ``prompt`` (``[T]`` or ``[B, T]``) by ``max_new_tokens``; return only the new ids.

        ``temperature=0`` is greedy. Otherwise logits are divided by the temperature, cut to the ``top_k`` most
        likely and to the smallest set whose probability reaches ``top_p``, and sampled with ``seed``.
        """
        from kvlab.model.sampling import sample_next

        prompt = torch.as_tensor(prompt, dtype=torch.long, device=self.device)
        squeeze = prompt.dim() == 1
        prompt = prompt[None] if squeeze else prompt
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: {max_new_tokens}; allowed: an integer >= 0")
        if prompt.shape[1] == 0:
            raise ValueError("prompt: empty; allowed: at least one token")
        if cache is None:
            cache = self.new_cache(prompt.shape[0], capacity=prompt.shape[1] + max(max_new_tokens, 1))
        gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        out = torch.empty(prompt.shape[0], max_new_tokens, dtype=torch.long, device=self.device)
        if max_new_tokens:
            logits = self.prefill(prompt, cache)[:, -1]
            for i in range(max_new_tokens):
                out[:, i] = sample_next(logits, temperature, top_k, top_p, gen)
                if i + 1 < max_new_tokens:
                    logits = self.decode_step(out[:, i], cache)
        return out[0] if squeeze else out


def set_absorb(model: Decoder, absorb: bool) -> Decoder:
    """Switch every MLA layer of ``model`` to the absorbed (``True``) or the naive (``False``) path; returns it."""
    if model.cfg.mla is None:
        raise ValueError(f"model: {model.cfg.name} has no MLA layers; allowed: a Decoder built with mla=MLAConfig")
    for block in model.layers:
        block.attn.absorb = absorb
    return model
