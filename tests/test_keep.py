"""The one window + sinks rule (kvlab.spec.keep): its spans, blocks and evictions agree with its own predicate,
checked position by position, and the kernels' mask is that predicate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlab.kernels.reference import window_mask
from kvlab.spec.keep import SinksAndWindow, blocks_inside, count_blocks

windows = st.one_of(st.none(), st.integers(1, 12))
rules = st.builds(lambda w, s: SinksAndWindow(w, 0 if w is None else s), windows, st.integers(0, 6))


def _seen(rule: SinksAndWindow, first: int, end: int, layer_window: int | None) -> set[int]:
    """Brute force: every key position some query at first .. end-1 sees."""
    return {k for q in range(first, end) for k in range(end) if rule.visible(q, k, layer_window)}


@given(rules, windows, st.integers(0, 40), st.integers(1, 8))
def test_spans_are_exactly_the_positions_some_query_sees(rule, layer_window, first, n_queries):
    end = first + n_queries
    spans = rule.spans(first, end, layer_window)
    positions = [p for lo, hi in spans for p in range(lo, hi)]
    assert positions == sorted(_seen(rule, first, end, layer_window))  # sorted, disjoint, nothing missing
    assert all(hi > lo for lo, hi in spans)


@given(rules, st.integers(0, 40))
def test_gone_positions_are_seen_by_no_later_query_in_any_layer(rule, first):
    lo, hi = rule.gone(first)
    later = range(first, first + 30)
    assert not any(rule.visible(q, k) for q in later for k in range(lo, hi))
    # and nothing a later query sees is missing from the kept spans: gone is all that may go
    if rule.window is not None:
        assert all(rule.visible(first, k) for k in range(hi, first + 1)) and hi >= rule.sinks


@given(rules, windows, st.integers(0, 40), st.integers(1, 8), st.integers(1, 5))
def test_block_answers_agree_with_the_positions(rule, layer_window, first, n_queries, block_size):
    spans = rule.spans(first, first + n_queries, layer_window)
    touching = {p // block_size for lo, hi in spans for p in range(lo, hi)}
    assert count_blocks(spans, block_size) == len(touching)
    lo, hi = rule.gone(first)
    whole = {b for b in range(hi // block_size + 1) if lo <= b * block_size and (b + 1) * block_size <= hi}
    assert set(blocks_inside((lo, hi), block_size)) == whole


@given(rules, windows)
def test_the_kernels_mask_is_the_rule(rule, layer_window):
    q, k = torch.arange(5, 20), torch.arange(20)
    mask = window_mask(q, k, rule.window, rule.sinks, layer_window)
    want = torch.tensor([[bool(rule.visible(int(a), int(b), layer_window)) for b in k] for a in q])
    assert torch.equal(mask, want)


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"window": 0}, "window"), ({"window": 4, "sinks": -1}, "sinks"), ({"sinks": 2}, "sinks")]
)
def test_bad_rules_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SinksAndWindow(**kwargs)
