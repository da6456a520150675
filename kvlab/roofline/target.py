"""What ``kvlab predict`` and ``kvlab report`` share: a model on a memory system, and the prediction's JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvlab.roofline.bytes import Prediction
from kvlab.roofline.speculative import SpeculativePrediction
from kvlab.spec.config import ModelConfig
from kvlab.spec.presets import GPU


@dataclass(frozen=True)
class Target:
    """What ``predict`` and ``report`` share: the model, where its bandwidth comes from, and its memory (GB or None)."""

    cfg: ModelConfig
    bandwidth_gbps: float
    bandwidth_source: str
    gpu: GPU | None
    memory_gb: float | None
    hardware_class: str | None = None  # which published measurements the real-system range compares against


def predict_json(cfg: ModelConfig, p: Prediction, spec: SpeculativePrediction | None, memory_gb: float | None) -> dict:
    """What ``kvlab predict --json`` prints; ``kvlab report`` embeds the same dict."""
    out = p.to_dict() | {"attention": cfg.attention_kind, "memory_needed_bytes": p.weight_bytes + p.kv_bytes}
    if spec is not None:
        out["speculative"] = asdict(spec)
    if memory_gb is not None:
        out["gpu_memory_bytes"] = round(memory_gb * 1e9)
    return out


def gb_text(n: float) -> str:
    """Bytes as ``kvlab predict`` and ``kvlab report`` print them: decimal GB, two decimals."""
    return f"{n / 1e9:,.2f} GB"
