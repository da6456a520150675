"""ModelConfig: the shape of a Llama-style decoder, validated, plus what the byte model needs beyond it.

A config is the single description of a model that both the runnable ``Decoder`` and the byte model
(``kvlab.roofline``) read. Fields beyond the Llama shape (per-layer windows, MLA, a published parameter count)
exist so that real models' byte accounting is right even where kvlab cannot run them yet.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.spec.dtypes import BYTES_PER_ELEMENT, COMPUTE_DTYPES, canonical_dtype
from kvlab.spec.validation import require_bool, require_int, require_number

RUNNABLE_ROPE_TYPES = ("default", "llama3")
# The parts of a checkpoint that can ship in different dtypes: the input embedding table and the LM head, the MoE
# experts (routed and shared), and everything else (attention, dense MLPs, routers, norms).
WEIGHT_COMPONENTS = ("embeddings", "experts", "other")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-style multi-head latent attention: what each token caches is one latent per layer.

    The cache holds ``kv_lora_rank + qk_rope_head_dim`` elements per token per layer, shared by all heads.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            require_int(f"mla.{name}", getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"mla.qk_rope_head_dim: {self.qk_rope_head_dim} is odd; allowed: an even number (RoPE rotates pairs)"
            )
        if self.q_lora_rank is not None:
            require_int("mla.q_lora_rank", self.q_lora_rank)

    @property
    def cached_elements_per_layer(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token runs ``top_k`` of ``n_experts`` routed experts plus every shared one.

    - ``expert_d_ff``: one expert's SwiGLU width; an expert holds ``3 x d_model x expert_d_ff`` weights (gate, up,
      down), a shared expert the same.
    - ``n_dense_layers``: the first layers keep a dense MLP of width ``ModelConfig.d_ff`` (DeepSeek's
      ``first_k_dense_replace``); the rest are MoE layers, each with a router of ``d_model x n_experts`` weights.
    """

    n_experts: int
    top_k: int
    expert_d_ff: int
    n_shared_experts: int = 0
    n_dense_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "expert_d_ff"):
            require_int(f"moe.{name}", getattr(self, name))
        for name in ("n_shared_experts", "n_dense_layers"):
            require_int(f"moe.{name}", getattr(self, name), 0)
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k: {self.top_k}; allowed: at most n_experts={self.n_experts}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, SwiGLU).

    MHA, GQA and MQA all come from ``n_kv_heads``: equal to ``n_heads`` is MHA, 1 is MQA, anything between
    that divides ``n_heads`` is GQA.

    Fields beyond the Llama shape:
    - ``layer_windows``: one entry per layer, ``None`` for a global layer or the window in tokens for a local
      (sliding-window) layer. ``None`` for the whole tuple means every layer is global.
    - ``mla``: the latent-attention shape, for DeepSeek-style models (runnable: see ``kvlab.model.mla``). Its query/key
      head is ``qk_nope_head_dim + qk_rope_head_dim``, which ``head_dim`` defaults to and must equal.
    - ``rope_scaling``: Hugging Face's ``rope_parameters`` beyond the default, as sorted ``(key, value)`` pairs
      (``rope_type="llama3"`` is runnable; other types are kept for the record).
    - ``moe``: the mixture-of-experts structure (``MoEConfig``); the byte model charges a step only the experts its
      batch routes to (``kvlab.roofline.active_params``). Not runnable.
    - ``weight_dtypes``: the dtype each part of the released checkpoint ships in, as sorted ``(component, dtype)``
      pairs over ``WEIGHT_COMPONENTS`` (DeepSeek-V3: FP8 with BF16 embeddings; gpt-oss: MXFP4 experts). A part not
      listed ships in ``dtype``. ``None``: everything ships in ``dtype``.
    - ``n_params``: a published parameter count, for models whose blocks a Llama shape only stands in for (GPT-2).
      ``None`` means count the parameters of the shape itself.
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    vocab_size: int = 32000
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "fp32"
    layer_windows: tuple[int | None, ...] | None = None
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    weight_dtypes: tuple[tuple[str, str], ...] | None = None
    n_params: int | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len"):
            require_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        require_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            divisors = [k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]
            raise ValueError(
                f"n_kv_heads: {self.n_kv_heads} does not divide n_heads={self.n_heads}; "
                f"allowed: a divisor of n_heads ({', '.join(map(str, divisors))})"
            )
        if self.mla is not None:
            qk_dim = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
            if self.head_dim is None:
                object.__setattr__(self, "head_dim", qk_dim)
            elif self.head_dim != qk_dim:
                raise ValueError(
                    f"head_dim: {self.head_dim} with MLA; allowed: qk_nope_head_dim + qk_rope_head_dim = {qk_dim} "
                    "(or leave head_dim unset)"
                )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"head_dim: not given and d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "allowed: give head_dim explicitly, or a d_model that n_heads divides"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        require_int("head_dim", self.head_dim)
        if self.mla is None and self.head_dim % 2:  # MLA ropes only its qk_rope part, checked in MLAConfig
            raise ValueError(f"head_dim: {self.head_dim} is odd; allowed: an even number (RoPE rotates pairs)")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", _default_d_ff(self.d_model))
        require_int("d_ff", self.d_ff)
        for name in ("rope_theta", "norm_eps"):
            require_number(name, getattr(self, name), 0, low_open=True)
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(sorted(dict(self.rope_scaling).items())))
        require_bool("tie_embeddings", self.tie_embeddings)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "dtype", allowed=tuple(COMPUTE_DTYPES)))
        if self.layer_windows is not None:
            windows = tuple(self.layer_windows)
            if len(windows) != self.n_layers:
                raise ValueError(
                    f"layer_windows: has {len(windows)} entries; allowed: exactly n_layers={self.n_layers} "
                    "(None for a global layer, a window in tokens for a local one)"
                )
            for i, w in enumerate(windows):
                if w is not None:
                    require_int(f"layer_windows[{i}]", w)
            object.__setattr__(self, "layer_windows", windows)
        if self.n_params is not None:
            require_int("n_params", self.n_params)
        if self.moe is not None and self.moe.n_dense_layers >= self.n_layers:
            raise ValueError(
                f"moe.n_dense_layers: {self.moe.n_dense_layers}; allowed: fewer than n_layers={self.n_layers}"
            )
        if self.weight_dtypes is not None:
            shipped = {}
            for component, dtype in dict(self.weight_dtypes).items():
                if component not in WEIGHT_COMPONENTS:
                    raise ValueError(
                        f"weight_dtypes: unknown component {component!r}; allowed: {', '.join(WEIGHT_COMPONENTS)}"
                    )
                shipped[component] = canonical_dtype(dtype, f"weight_dtypes[{component!r}]", tuple(BYTES_PER_ELEMENT))
            object.__setattr__(self, "weight_dtypes", tuple(sorted(shipped.items())) or None)

    # -- derived shape -------------------------------------------------------------------------------------------
    @property
    def n_groups(self) -> int:
        """Query heads per KV head: 1 for MHA, n_heads for MQA."""
        return self.n_heads // self.n_kv_heads

    @property
    def attention_kind(self) -> str:
        if self.mla is not None:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else f"GQA-{self.n_kv_heads}"

    @property
    def runnable(self) -> bool:
        """Whether ``kvlab.Decoder`` can run this shape (everything but mixture-of-experts and exotic RoPE)."""
        return self.not_runnable_reason is None

    @property
    def not_runnable_reason(self) -> str | None:
        if self.moe is not None:
            return "mixture-of-experts blocks are accounted for by the byte model but not runnable"
        rope_type = dict(self.rope_scaling or ()).get("rope_type", "default")
        if rope_type not in RUNNABLE_ROPE_TYPES:
            return f"rope_type {rope_type!r} is not runnable; allowed: {', '.join(RUNNABLE_ROPE_TYPES)}"
        return None

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    # -- Hugging Face config.json ----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, source: str | Path | dict[str, Any] | Any) -> ModelConfig:
        """Read a Llama-style Hugging Face ``config.json`` (a path, a folder, a dict, or a transformers config).

        Keys read: ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
        ``head_dim``, ``intermediate_size``, ``vocab_size``, ``max_position_embeddings``, ``rope_theta`` (or
        ``rope_parameters.rope_theta``), ``rms_norm_eps``, ``tie_word_embeddings``, ``torch_dtype``/``dtype``,
        ``sliding_window`` with ``layer_types``, DeepSeek's MLA keys, the mixture-of-experts keys of Mixtral,
        DeepSeek, Qwen-MoE and gpt-oss (see ``_hf_moe``), and ``quantization_config.quant_method`` ``fp8`` or
        ``mxfp4`` for the shipped weight dtypes.
        """
        hf = _load_hf_dict(source)
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json: missing {', '.join(missing)}; allowed: a Llama-style config.json")
        n_layers = hf["num_hidden_layers"]
        # transformers 5 writes rope_parameters (theta included); 4.x wrote rope_theta and rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(hf.get("rope_theta", rope.pop("rope_theta", 10000.0)))
        rope.pop("rope_theta", None)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "fp32"
        mla = None
        if hf.get("kv_lora_rank"):
            mla = MLAConfig(
                kv_lora_rank=hf["kv_lora_rank"],
                qk_rope_head_dim=hf["qk_rope_head_dim"],
                qk_nope_head_dim=hf["qk_nope_head_dim"],
                v_head_dim=hf["v_head_dim"],
                q_lora_rank=hf.get("q_lora_rank"),
            )
        moe = _hf_moe(hf)
        return cls(
            n_layers=n_layers,
            d_model=hf["hidden_size"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            # transformers' DeepSeek configs set head_dim to the RoPE width; MLA's query/key head is derived instead.
            head_dim=None if mla else hf.get("head_dim"),
            # a MoE config's intermediate_size is its dense layers' width (DeepSeek) or its experts' (Mixtral)
            d_ff=hf.get("intermediate_size"),
            vocab_size=hf.get("vocab_size", 32000),
            max_seq_len=hf.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted(rope.items())) or None,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
            layer_windows=_hf_layer_windows(hf, n_layers),
            mla=mla,
            moe=moe,
            weight_dtypes=_hf_weight_dtypes(hf, moe),
            name=str(hf.get("_name_or_path") or hf.get("model_type") or "custom"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The Llama ``config.json`` dict for this shape (dense, global attention only)."""
        if not self.runnable:
            raise ValueError(f"to_hf_config: {self.not_runnable_reason}")
        if self.mla is not None:
            raise ValueError("to_hf_config: MLA attention has no Llama config.json; allowed: an MHA, GQA or MQA shape")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": self.n_layers,
            "hidden_size": self.d_model,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.d_ff,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": COMPUTE_DTYPES[self.dtype],
        }


def _default_d_ff(d_model: int) -> int:
    # Llama's rule: 2/3 of 4*d, rounded up to a multiple of 64, so SwiGLU's three matrices cost what a 4x MLP does.
    return 64 * math.ceil(8 * d_model / 3 / 64)


def _load_hf_dict(source: Any) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if hasattr(source, "to_dict"):
        return source.to_dict()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config: {str(path)!r} does not exist; allowed: a config.json file or a folder holding one")
    return json.loads(path.read_text())


def _hf_layer_windows(hf: dict[str, Any], n_layers: int) -> tuple[int | None, ...] | None:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types:
        if not window:
            return None
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    # Mistral and Qwen2 configs carry sliding_window without layer_types; Qwen2 also has an off switch.
    if window and hf.get("use_sliding_window", True):
        return (int(window),) * n_layers
    return None


def _hf_moe(hf: dict[str, Any]) -> MoEConfig | None:
    """The expert structure, under each family's key names (Mixtral and gpt-oss ``num_local_experts``, DeepSeek
    ``n_routed_experts``, Qwen-MoE ``num_experts``; experts' width ``moe_intermediate_size``, else
    ``intermediate_size``)."""
    n_experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts")
    if not n_experts:
        return None
    return MoEConfig(
        n_experts=n_experts,
        top_k=hf.get("num_experts_per_tok") or hf.get("experts_per_token"),
        expert_d_ff=hf.get("moe_intermediate_size") or hf["intermediate_size"],
        n_shared_experts=hf.get("n_shared_experts") or 0,
        n_dense_layers=hf.get("first_k_dense_replace") or 0,
    )


def _hf_weight_dtypes(hf: dict[str, Any], moe: MoEConfig | None) -> tuple[tuple[str, str], ...] | None:
    # DeepSeek's fp8 checkpoints keep the embedding and LM head in BF16; gpt-oss's mxfp4 covers the experts only.
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method == "fp8":
        return (("experts", "fp8"), ("other", "fp8")) if moe else (("other", "fp8"),)
    if method == "mxfp4" and moe:
        return (("experts", "mxfp4"),)
    return None
