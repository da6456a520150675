"""Hugging Face interop: load a Llama-architecture checkpoint into a kvlab ``Decoder``, and back.

Never touches the network: a checkpoint is a local folder (``config.json`` plus ``*.safetensors``) or a
transformers model already in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvlab.model.decoder import Decoder
from kvlab.spec.config import ModelConfig
from kvlab.spec.dtypes import canonical_dtype

_HF_LAYER = "model.layers.{i}."


def _hf_to_kvlab(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and re-lay a Llama state dict: projections become ``[in, out]``, Q|K|V and gate|up are fused."""

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise ValueError(f"checkpoint: missing tensor {key!r}; allowed: a LlamaForCausalLM state dict")
        return hf[key]

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head"] = take("lm_head.weight").T
    for i in range(cfg.n_layers):
        p = _HF_LAYER.format(i=i)
        attn = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        out[f"layers.{i}.attn.wqkv"] = torch.cat(attn, dim=0).T
        out[f"layers.{i}.attn.wo"] = take(p + "self_attn.o_proj.weight").T
        gate_up = [take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
        out[f"layers.{i}.mlp.w_gate_up"] = torch.cat(gate_up, dim=0).T
        out[f"layers.{i}.mlp.w_down"] = take(p + "mlp.down_proj.weight").T
        out[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
    return {k: v.contiguous() for k, v in out.items()}


def _kvlab_to_hf(model: Decoder) -> dict[str, torch.Tensor]:
    cfg, sd = model.cfg, model.state_dict()
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    out["lm_head.weight"] = sd["embed.weight"] if cfg.tie_embeddings else sd["lm_head"].T
    for i in range(cfg.n_layers):
        p = _HF_LAYER.format(i=i)
        q, k, v = sd[f"layers.{i}.attn.wqkv"].T.split([q_dim, kv_dim, kv_dim])
        out |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v}
        out[p + "self_attn.o_proj.weight"] = sd[f"layers.{i}.attn.wo"].T
        gate, up = sd[f"layers.{i}.mlp.w_gate_up"].T.chunk(2)
        out |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
        out[p + "mlp.down_proj.weight"] = sd[f"layers.{i}.mlp.w_down"].T
        out[p + "input_layernorm.weight"] = sd[f"layers.{i}.attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[f"layers.{i}.mlp_norm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"checkpoint: no *.safetensors in {str(folder)!r}; allowed: a folder with config.json and weights"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def from_hf(source: str | Path | Any, device: str | torch.device | None = None, dtype: str | None = None) -> Decoder:
    """A ``Decoder`` with the weights of a Llama-architecture checkpoint.

    ``source``: a local folder holding ``config.json`` and ``*.safetensors`` (sharded files are merged), or an
    in-memory transformers ``LlamaForCausalLM``. ``dtype`` defaults to the checkpoint's.
    """
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if not (folder / "config.json").is_file():
            raise ValueError(f"source: {str(folder)!r} has no config.json; allowed: a local checkpoint folder")
        cfg = ModelConfig.from_hf_config(folder)
        state = _read_safetensors(folder)
    elif hasattr(source, "config") and hasattr(source, "state_dict"):
        cfg = ModelConfig.from_hf_config(source.config)
        state = source.state_dict()
    else:
        raise ValueError(f"source: {type(source).__name__}; allowed: a checkpoint folder or a transformers model")
    if dtype is not None:
        cfg = cfg.replace(dtype=canonical_dtype(dtype))
    if cfg.tie_embeddings and "lm_head.weight" in state and "model.embed_tokens.weight" in state:
        # Tied checkpoints may or may not store the head; kvlab reads the embedding either way.
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    model = Decoder(cfg, device=device, seed=None)
    model.load_state_dict(_hf_to_kvlab(cfg, state))
    return model


def to_hf(model: Decoder):
    """The same weights as a transformers ``LlamaForCausalLM`` (for side-by-side comparisons)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**model.cfg.to_hf_config()))
    hf.load_state_dict(_kvlab_to_hf(model), strict=not model.cfg.tie_embeddings)
    return hf.to(device=model.device, dtype=model.torch_dtype).eval()


def save_hf(model: Decoder, folder: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` as a Llama checkpoint folder."""
    import json

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf_config(), indent=2))
    state = _kvlab_to_hf(model)
    if model.cfg.tie_embeddings:
        del state["lm_head.weight"]
    save_file({k: v.cpu() for k, v in state.items()}, str(folder / "model.safetensors"))
