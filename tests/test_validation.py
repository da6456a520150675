"""The shared argument checks: each accepts exactly its range and refuses the rest with a message naming the field,
the value and what is allowed."""

from __future__ import annotations

import math
import re

import pytest

from kvlab.spec.validation import require_bool, require_fraction, require_int, require_number


def refused(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        call(*args, **kwargs)
    return str(e.value)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("n", 1), {}),
        (("n", 0, 0), {}),
        (("n", -5, None), {}),
        (("n", 10**30), {}),
        (("n", 3, 1, 3), {}),
        (("n", 1, 1, 1), {}),
        (("n", None), {"or_none": True}),
    ],
)
def test_require_int_accepts_its_range(args, kwargs):
    assert require_int(*args, **kwargs) is None


@pytest.mark.parametrize(
    ("value", "low", "high", "allowed"),
    [
        (0, 1, None, "an integer >= 1"),
        (4, 1, 3, "an integer in [1, 3]"),
        (-1, 0, 3, "an integer in [0, 3]"),
        (5, None, 4, "an integer <= 4"),
        (True, 1, None, "an integer >= 1"),
        (False, 0, None, "an integer >= 0"),
        (2.0, 1, None, "an integer >= 1"),
        ("2", 1, None, "an integer >= 1"),
        (None, 1, None, "an integer >= 1"),
    ],
)
def test_require_int_refuses_naming_field_value_and_range(value, low, high, allowed):
    message = refused(require_int, "batch", value, low, high)
    assert message == f"batch: {value!r} is not allowed; allowed: {allowed}"


def test_require_int_note_and_none_join_the_allowed_values():
    message = refused(require_int, "top_k", 0, note="the k most likely tokens", or_none=True)
    assert message == "top_k: 0 is not allowed; allowed: an integer >= 1 (the k most likely tokens), or None"


@pytest.mark.parametrize(
    ("value", "low", "high", "kwargs"),
    [
        (0, None, None, {}),
        (-1e300, None, None, {}),
        (0.5, 0, 1, {}),
        (0, 0, 1, {}),
        (1, 0, 1, {}),
        (1e-300, 0, None, {"low_open": True}),
        (0.999, None, 1, {"high_open": True}),
        (None, 0, 1, {"or_none": True}),
    ],
)
def test_require_number_accepts_its_range(value, low, high, kwargs):
    assert require_number("x", value, low, high, **kwargs) is None


@pytest.mark.parametrize(
    ("value", "low", "high", "kwargs", "allowed"),
    [
        (0, 0, None, {"low_open": True}, "a finite number > 0"),
        (-0.5, 0, None, {}, "a finite number >= 0"),
        (1, None, 1, {"high_open": True}, "a finite number < 1"),
        (2, None, 1, {}, "a finite number <= 1"),
        (0, 0, 1, {"low_open": True}, "a number in (0, 1]"),
        (1, 0, 1, {"high_open": True}, "a number in [0, 1)"),
        (1.5, 0, 1, {}, "a number in [0, 1]"),
        (math.nan, None, None, {}, "a finite number"),
        (math.inf, 0, None, {}, "a finite number >= 0"),
        (-math.inf, None, None, {}, "a finite number"),
        (math.nan, 0, 1, {}, "a number in [0, 1]"),
        (True, 0, 1, {}, "a number in [0, 1]"),
        (False, None, None, {}, "a finite number"),
        ("0.5", 0, 1, {}, "a number in [0, 1]"),
    ],
)
def test_require_number_refuses_naming_field_value_and_range(value, low, high, kwargs, allowed):
    message = refused(require_number, "rate", value, low, high, **kwargs)
    assert message == f"rate: {value!r} is not allowed; allowed: {allowed}"


def test_require_number_note_and_none_join_the_allowed_values():
    message = refused(require_number, "temperature", -1, 0, note="0 is greedy", or_none=True)
    assert message == "temperature: -1 is not allowed; allowed: a finite number >= 0 (0 is greedy), or None"


@pytest.mark.parametrize("value", [0, 0.25, 1, 1.0])
def test_require_fraction_accepts_the_unit_interval(value):
    assert require_fraction("depth", value) is None


@pytest.mark.parametrize("value", [-0.01, 1.01, math.nan, True, "0.5", None])
def test_require_fraction_refuses_the_rest(value):
    assert refused(require_fraction, "depth", value) == f"depth: {value!r} is not allowed; allowed: a number in [0, 1]"


@pytest.mark.parametrize("value", [True, False])
def test_require_bool_accepts_a_bool(value):
    assert require_bool("one_pass", value) is None


@pytest.mark.parametrize("value", [0, 1, "True", None, 1.0])
def test_require_bool_refuses_what_only_looks_like_one(value):
    message = refused(require_bool, "one_pass", value)
    assert re.fullmatch(r"one_pass: .* is not allowed; allowed: True or False", message)
    assert repr(value) in message
