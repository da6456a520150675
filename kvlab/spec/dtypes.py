"""Dtype names used across kvlab: one table, so the CLI, the configs and the byte model agree.

Every dtype has a canonical short name (``fp32``, ``bf16``, ...) and a size in bytes per element.
``int4`` is half a byte: two values share one byte when packed. ``mxfp4`` (OCP microscaling FP4, the format
gpt-oss ships its experts in) is 4.25 bits: 4-bit values plus one 8-bit shared scale per block of 32, so its size
already includes its scales. It is a weight format only; ``KV_DTYPES`` lists what a KV cache can be stored in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BYTES_PER_ELEMENT: dict[str, float] = {
    "fp32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8-tensor": 1,
    "int8": 1,
    "int4": 0.5,
    "mxfp4": (32 * 4 + 8) / 8 / 32,
}

# ``fp8-tensor``: e4m3 with one scale per tensor (vLLM's FP8 KV cache by default), left at 1.0 as vLLM leaves it
# without calibration; the scale is a constant of the model, not stored per group, so it costs no KV bytes.
KV_DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", "fp8-tensor", "int8", "int4")

# Statistics a quantized KV dtype stores per group of elements, each one fp16 (KIVI's layout, as kvlab.cache.codec
# stores it): fp8 a scale; int8 and int4 a scale and a zero point. Float KV dtypes are a cast and store none.
KV_GROUP_STATS: dict[str, int] = {"fp8": 1, "int8": 2, "int4": 2}
GROUP_STAT_BYTES = 2

ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
    "e4m3": "fp8",
    "i8": "int8",
    "i4": "int4",
    "mx_fp4": "mxfp4",
    "mxfp4_e2m1": "mxfp4",
}

# Dtypes a Decoder can hold its weights and run in, each with torch's name for it. The others exist only in the
# byte model (and, for the KV cache, in the codecs). Names, not torch.dtype objects: the byte model imports this
# module and must not load torch.
COMPUTE_DTYPES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def canonical_dtype(name: str | torch.dtype, field: str = "dtype", allowed: tuple[str, ...] | None = None) -> str:
    """Return the canonical name of a dtype, or raise ``ValueError`` naming ``field`` and the allowed names.

    ``name`` may be a torch.dtype: its ``str`` (``"torch.bfloat16"``) is read like any other name.
    """
    allowed = tuple(BYTES_PER_ELEMENT) if allowed is None else allowed
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in allowed:
        raise ValueError(f"{field}: unknown dtype {name!r}; allowed: {', '.join(allowed)}")
    return key


def bytes_per_element(name: str | torch.dtype, field: str = "dtype", allowed: tuple[str, ...] | None = None) -> float:
    """Bytes one element takes in storage: 4 for fp32, 0.5 for packed int4, 0.53125 for mxfp4 (scales included)."""
    return BYTES_PER_ELEMENT[canonical_dtype(name, field, allowed)]


def to_torch(name: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """The torch dtype a model can compute in (fp32, fp16, bf16)."""
    import torch  # here, not at the top: only a caller that already runs torch needs it

    return getattr(torch, COMPUTE_DTYPES[canonical_dtype(name, field, allowed=tuple(COMPUTE_DTYPES))])
