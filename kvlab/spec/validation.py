"""Argument checks shared by every module, so each bad value gets the same clear message."""

from __future__ import annotations


def require_int(name: str, value: object, low: int = 1) -> None:
    """Raise ``ValueError`` naming ``name`` and what is allowed unless ``value`` is an integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: {value!r} is not allowed; allowed: an integer >= {low}")


def require_fraction(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a number in [0, 1] (a depth, a probability)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name}: {value!r} is not allowed; allowed: a number in [0, 1]")
