"""Named model shapes and GPUs, from verified reference figures (sources in ``data/reference_presets.md``).

Real-model presets carry random weights when run: kvlab never downloads a checkpoint. A dense preset's MLP width is
the one that makes a Llama-style block reproduce the published parameter count, which for the Llama, Mistral, Qwen
and Gemma-2 rows equals the model's own ``intermediate_size``; other rows give ``intermediate_size`` from the
model's config. Mixture-of-experts presets carry their expert structure (``MoEConfig``), and every preset its own
context length and the dtypes its checkpoint ships in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from kvlab.spec.config import MLAConfig, ModelConfig, MoEConfig
from kvlab.spec.validation import require_int

# Course-sized shapes: small enough to decode on a laptop CPU, large enough that the KV term is measurable.
_COURSE_PRESETS = {
    "cpu-tiny": ModelConfig(
        n_layers=4,
        d_model=256,
        n_heads=4,
        n_kv_heads=4,
        d_ff=768,
        vocab_size=4096,
        max_seq_len=8192,
        name="cpu-tiny",
    ),
    "cpu-small": ModelConfig(
        n_layers=8,
        d_model=512,
        n_heads=8,
        n_kv_heads=8,
        d_ff=1536,
        vocab_size=8192,
        max_seq_len=65536,
        name="cpu-small",
    ),
}


@dataclass(frozen=True)
class GPU:
    """A GPU's datasheet figures (dense, not 2:4-sparse)."""

    name: str
    memory_gb: float
    bandwidth_gbps: float
    bf16_tflops: float | None
    fp8_tflops: float | None
    source: str
    tflops_note: str | None = None  # e.g. which accumulate precision the TFLOP/s figures assume
    hardware_class: str | None = None  # kvlab.spec.published.HARDWARE_CLASSES: which published measurements compare


@cache
def _reference() -> dict:
    text = resources.files("kvlab.data").joinpath("reference_presets.json").read_text()
    return json.loads(text)


def _model_from_reference(name: str, m: dict) -> ModelConfig:
    d, n_layers, heads, vocab = m["hidden"], m["layers"], m["heads"], m["vocab"]
    tied = bool(m.get("tied_embeddings", False))
    window = m.get("window")
    layer_windows = None
    if window:
        layer_windows = _window_pattern(n_layers, window["size"], window["global_every"])
        n_global = sum(w is None for w in layer_windows)
        if n_global != window["global_layers"]:
            raise ValueError(
                f"window.global_layers: {window['global_layers']} for {name}; allowed: {n_global}, the count that "
                f"global_every={window['global_every']} gives over {n_layers} layers"
            )
    mla = None
    if m.get("mla"):
        x = m["mla"]
        mla = MLAConfig(
            x["kv_lora_rank"], x["qk_rope_head_dim"], x["qk_nope_head_dim"], x["v_head_dim"], x["q_lora_rank"]
        )
        head_dim, kv_heads = x["qk_nope_head_dim"] + x["qk_rope_head_dim"], heads
    else:
        head_dim, kv_heads = m["head_dim"], m["kv_heads"]
    moe = None
    if m.get("moe"):
        x = m["moe"]
        moe = MoEConfig(x["experts"], x["top_k"], x["expert_d_ff"], x["shared_experts"], x["dense_layers"])
    params = None if m["params_b"] is None else round(m["params_b"] * 1e9)
    # GPT-2's block (LayerNorm, a 4x GELU MLP, learned positions) is not a Llama block: count it by its published size
    stand_in = name.startswith("gpt2")
    if "intermediate_size" in m:
        d_ff = m["intermediate_size"]
    elif params is not None:
        d_ff = _d_ff_for_params(params, n_layers, d, heads, kv_heads, head_dim, vocab, tied)
    else:
        d_ff = None
    return ModelConfig(
        n_layers=n_layers,
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        d_ff=d_ff,
        vocab_size=vocab,
        max_seq_len=m["max_context"],
        tie_embeddings=tied,
        dtype="bf16",
        layer_windows=layer_windows,
        mla=mla,
        moe=moe,
        weight_dtypes=tuple(sorted(m["weight_dtypes"].items())) if m.get("weight_dtypes") else None,
        n_params=params if stand_in else None,
        name=name,
    )


def _d_ff_for_params(
    params: int, n_layers: int, d: int, heads: int, kv_heads: int, head_dim: int, vocab: int, tied: bool
) -> int:
    """The MLP width, to a multiple of 256, at which a Llama-style block has the published parameter count."""
    embeddings = vocab * d * (1 if tied else 2)
    attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim
    per_layer = (params - embeddings - d) / n_layers - attention - 2 * d
    return 256 * round(per_layer / (3 * d) / 256)


def _window_pattern(n_layers: int, size: int, global_every: int | None) -> tuple[int | None, ...]:
    """Local layers with a ``size``-token window; layer ``i`` (0-based) is global when ``(i + 1) % global_every == 0``.

    That is Hugging Face's rule for Gemma-2 (``global_every`` 2: layers 1, 3, ...), gpt-oss (2) and Gemma-3 (6:
    layers 5, 11, ..., 59, so its last two layers, 60 and 61, are local). ``None``: every layer is local (Mistral).
    """
    if global_every is not None:
        require_int("window.global_every", global_every)
    return tuple(None if global_every is not None and (i + 1) % global_every == 0 else size for i in range(n_layers))


@cache
def model_presets() -> dict[str, ModelConfig]:
    """Every named model shape: the course's CPU models first, then the real models in the reference table."""
    real = {name: _model_from_reference(name, m) for name, m in _reference()["models"].items()}
    return {**_COURSE_PRESETS, **real}


@cache
def draft_presets() -> dict[str, ModelConfig]:
    """Shapes that exist only to draft for another model (``draft_of``): DeepSeek-V3's multi-token-prediction
    module. ``get_model`` finds them too; they are kept out of ``model_presets``, which lists models to serve."""
    return {name: _model_from_reference(name, m) for name, m in _reference().get("drafts", {}).items()}


@cache
def gpu_presets() -> dict[str, GPU]:
    out = {}
    for name, g in _reference()["gpus"].items():
        out[name] = GPU(
            name=name,
            memory_gb=g["hbm_gb"],
            bandwidth_gbps=g["bw_tbs"] * 1000,
            bf16_tflops=g["bf16_tflops"],
            fp8_tflops=g["fp8_tflops"],
            source=_GPU_SOURCE,
            tflops_note=g.get("tflops_note"),
            hardware_class=g["hardware_class"],
        )
    return out


_GPU_SOURCE = "vendor datasheets (dense figures), as collected in kvlab/data/reference_presets.md"


def get_model(name: str, field: str = "model") -> ModelConfig:
    """A named model shape; ``ValueError`` names ``field`` and lists the presets when it is unknown."""
    return _lookup({**model_presets(), **draft_presets()}, name, field)


def get_gpu(name: str, field: str = "gpu") -> GPU:
    return _lookup(gpu_presets(), name, field)


def _lookup(presets: dict, name: str, field: str):
    key = name.strip().lower()
    if key not in presets:
        raise ValueError(f"{field}: unknown preset {name!r}; allowed: {', '.join(presets)}")
    return presets[key]


def _entry(name: str) -> dict:
    """A preset's entry in the reference table (a model or a draft); empty for a course preset or an unknown name."""
    ref = _reference()
    return ref["models"].get(name) or ref.get("drafts", {}).get(name) or {}


def tokenizer_of(name: str) -> str | None:
    """The tokenizer family a real-model preset uses (``tokenizer`` in the reference table); ``None``: not known
    (a course preset, or a name that is no preset)."""
    return _entry(name).get("tokenizer")


def served_context(name: str) -> int | None:
    """The context a model's makers document serving, where it is shorter than its config's
    ``max_position_embeddings`` (DeepSeek-V3: 128K against 163,840); ``None`` where none is recorded."""
    return _entry(name).get("served_context")


def draft_of(name: str) -> str | None:
    """The preset a draft-only preset belongs to (DeepSeek-V3's multi-token-prediction module: ``deepseek-v3``)."""
    return _entry(name).get("draft_of")


def same_vocabulary(target: ModelConfig, draft: ModelConfig) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (``None``: it can): a draft proposes token ids that the target
    verifies, so both must use one vocabulary, the same size and, where the presets say, the same tokenizer."""
    if draft.vocab_size != target.vocab_size:
        return (
            f"{draft.name}'s vocabulary has {draft.vocab_size:,} tokens and {target.name}'s {target.vocab_size:,}; "
            "allowed: a draft with the target's vocabulary"
        )
    theirs, ours = tokenizer_of(draft.name), tokenizer_of(target.name)
    if theirs and ours and theirs != ours:
        return (
            f"{draft.name} uses the {theirs} tokenizer and {target.name} the {ours} one ({target.vocab_size:,} tokens "
            "each, different tokens); allowed: a draft with the target's tokenizer"
        )
    return None


def params_verified(name: str) -> bool:
    """Whether the reference table gives a verified parameter count for this preset (course presets: counted)."""
    models = _reference()["models"]
    return name not in models or models[name]["params_b"] is not None
