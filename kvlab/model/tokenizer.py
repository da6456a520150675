"""Byte-level tokenizer: token ``i < 256`` is the byte ``i``; a few special tokens follow the bytes.

Bytes need no vocabulary file and no training, so any text (and any Python version's stdlib) encodes the same way
on every machine, and one text token is one byte: perplexity per token is perplexity per byte.

Special tokens, each written in text as ``<|...|>``:

- ``<|endoftext|>`` (``EOT``) ends a document.
- ``<|passkey:N|>`` for ``N`` in ``0 .. N_PASSKEYS-1`` and ``<|ask|>`` (``ASK``) make the passkey-retrieval task
  (``kvlab.measure.quality``): a passkey planted somewhere in the text, and a question after which the model must
  repeat it.
  A passkey is one token, so its key and value vectors are exactly what a cache policy keeps or drops.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kvlab.spec.validation import require_int

EOT = 256
EOT_TEXT = "<|endoftext|>"
# 16 passkeys (chance 1/16). A run with 64 also learned recall, but its answers stayed hard for 900 of 1,200
# steps and the text paid for it: held-out perplexity 4.77 against 4.28 with 16 (2026-11-30, needle_weight 1).
N_PASSKEYS = 16
PASSKEY_BASE = EOT + 1
ASK = PASSKEY_BASE + N_PASSKEYS
ASK_TEXT = "<|ask|>"
VOCAB_SIZE = ASK + 1

_SPECIAL = re.compile(r"<\|(endoftext|ask|passkey:(\d+))\|>")


def passkey(n: int) -> int:
    """The token id of passkey ``n``."""
    require_int("passkey", n, 0, N_PASSKEYS - 1)
    return PASSKEY_BASE + n


def is_passkey(ids: torch.Tensor) -> torch.Tensor:
    """Elementwise: is the token a passkey (bool, shaped like ``ids``)."""
    return (ids >= PASSKEY_BASE) & (ids < PASSKEY_BASE + N_PASSKEYS)


def encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text``, with each special token written as ``<|...|>`` turned into its id.

    A ``<|passkey:N|>`` with ``N`` out of range stays literal text, as does any other ``<|...|>``.
    """
    ids: list[int] = []
    last = 0
    for match in _SPECIAL.finditer(text):
        number = match.group(2)
        if number is not None and int(number) >= N_PASSKEYS:
            continue
        ids.extend(text[last : match.start()].encode("utf-8"))
        name = match.group(1)
        ids.append(EOT if name == "endoftext" else ASK if name == "ask" else PASSKEY_BASE + int(number))
        last = match.end()
    ids.extend(text[last:].encode("utf-8"))
    return ids


def decode(ids: Iterable[int] | torch.Tensor) -> str:
    """Inverse of ``encode``; byte runs that are not valid UTF-8 decode to U+FFFD."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"ids: {bad[:5]} out of range; allowed: 0 <= id < {VOCAB_SIZE}")
    parts, run = [], bytearray()
    for i in ids:
        if i < 256:
            run.append(i)
            continue
        parts.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        parts.append(EOT_TEXT if i == EOT else ASK_TEXT if i == ASK else f"<|passkey:{i - PASSKEY_BASE}|>")
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)
