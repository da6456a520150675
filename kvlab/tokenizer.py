"""Byte-level tokenizer: token ``i < 256`` is the byte ``i``; one special token marks where a document ends.

Bytes need no vocabulary file and no training, so any text (and any Python version's stdlib) encodes the same way
on every machine, and one token is one byte: perplexity per token is perplexity per byte.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

EOT = 256
EOT_TEXT = "<|endoftext|>"
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text``, with each literal ``<|endoftext|>`` turned into the ``EOT`` token."""
    ids: list[int] = []
    for i, part in enumerate(text.split(EOT_TEXT)):
        if i:
            ids.append(EOT)
        ids.extend(part.encode("utf-8"))
    return ids


def decode(ids: Iterable[int] | torch.Tensor) -> str:
    """Inverse of ``encode``; byte runs that are not valid UTF-8 decode to U+FFFD."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"ids: {bad[:5]} out of range; allowed: 0 <= id < {VOCAB_SIZE}")
    parts, run = [], bytearray()
    for i in ids:
        if i == EOT:
            parts.append(run.decode("utf-8", errors="replace") + EOT_TEXT)
            run = bytearray()
        else:
            run.append(i)
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)
