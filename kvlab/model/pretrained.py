"""Checkpoints that ship inside the package, and the held-out text they are evaluated on. No network.

A checkpoint ``<name>`` is three files in ``kvlab/data/``: ``<name>.safetensors`` (weights), ``<name>.json``
(``{"model": ModelConfig fields, "training": ..., "eval": ...}``) and ``<name>.md`` (its card).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from kvlab.machine.device import resolve_device
from kvlab.model.decoder import Decoder
from kvlab.model.tokenizer import EOT, encode
from kvlab.spec.config import ModelConfig

HELDOUT_FILE = "stdlib_heldout.txt"


def _data() -> Any:
    return resources.files("kvlab.data")


def list_pretrained() -> list[str]:
    """Names of the shipped checkpoints, sorted."""
    names = {p.name.removesuffix(".safetensors") for p in _data().iterdir() if p.name.endswith(".safetensors")}
    return sorted(n for n in names if _data().joinpath(f"{n}.json").is_file())


def pretrained_info(name: str) -> dict[str, Any]:
    """The checkpoint's JSON record: model config, training settings and results, recorded evaluation."""
    if name not in list_pretrained():
        raise ValueError(f"name: {name!r} is not a shipped checkpoint; allowed: {', '.join(list_pretrained())}")
    return json.loads(_data().joinpath(f"{name}.json").read_text())


def bos_token(name: str) -> int | None:
    """The token checkpoint ``name`` saw first in every training sequence, to put before every text it reads
    (``kvlab.measure.quality``'s ``bos``); ``None`` for a checkpoint trained without one."""
    return EOT if pretrained_info(name)["training"].get("bos") else None


def load_pretrained(name: str, device: str | torch.device | None = None) -> Decoder:
    """The shipped checkpoint ``name`` as a ``Decoder`` in eval mode on ``device`` (default: CUDA if present)."""
    cfg = ModelConfig(**pretrained_info(name)["model"])
    # A fixed init seed keeps loading from touching the global RNG; every weight is overwritten anyway.
    model = Decoder(cfg, device="cpu", seed=0)
    model.load_state_dict(load_safetensors(_data().joinpath(f"{name}.safetensors").read_bytes()))
    return model.to(resolve_device(device))


@cache
def _heldout_ids() -> tuple[int, ...]:
    return tuple(encode(_data().joinpath(HELDOUT_FILE).read_text(encoding="utf-8")))


def heldout_tokens() -> torch.Tensor:
    """The shipped held-out evaluation text, byte-tokenized: ``[N]`` int64, identical on every machine."""
    return torch.tensor(_heldout_ids(), dtype=torch.long)
