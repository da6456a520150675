"""Argument checks shared by every module, so each bad value gets the same clear message.

Each ``require_*`` returns ``None`` or raises ``ValueError`` worded "name: value is not allowed; allowed: ...".
``bool`` is never a number here (``True`` would pass for 1), and a number is never a bool.
"""

from __future__ import annotations

import math


def _refuse(name: str, value: object, allowed: str, note: str, or_none: bool) -> ValueError:
    allowed += f" ({note})" if note else ""
    allowed += ", or None" if or_none else ""
    return ValueError(f"{name}: {value!r} is not allowed; allowed: {allowed}")


def require_int(
    name: str, value: object, low: int | None = 1, high: int | None = None, *, note: str = "", or_none: bool = False
) -> None:
    """Unless ``value`` is an ``int`` in ``[low, high]`` (both bounds inclusive; ``None``: unbounded), raise
    ``ValueError`` naming ``name``. ``note`` adds why to the message; ``or_none`` also accepts ``None``."""
    if value is None and or_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not _within(value, low, high, False, False):
        raise _refuse(name, value, "an integer" + _bounds(low, high, False, False), note, or_none)


def require_number(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
    or_none: bool = False,
) -> None:
    """Unless ``value`` is a finite ``int`` or ``float`` between ``low`` and ``high`` (``None``: unbounded), raise
    ``ValueError`` naming ``name``. Bounds are inclusive (closed) unless ``low_open`` / ``high_open`` exclude them.
    NaN and the infinities are always refused. ``note`` and ``or_none`` as in ``require_int``."""
    if value is None and or_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not _within(value, low, high, low_open, high_open)
    ):
        # Two bounds already say the number is finite.
        kind = "a number" if low is not None and high is not None else "a finite number"
        raise _refuse(name, value, kind + _bounds(low, high, low_open, high_open), note, or_none)


def require_fraction(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a number in [0, 1] (a depth, a probability)."""
    require_number(name, value, 0, 1)


def require_bool(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise _refuse(name, value, "True or False", "", False)


def _within(value: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    return above and below


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """The bounds as the message words them: ' >= 1', ' < 4', ' in (0, 1]', or '' for none."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""
