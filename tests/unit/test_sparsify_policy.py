"""CaR III-D's sparsification policy: keep ratios from profiled sparsity, relaxation towards dense,
per-block token counts and which tokens stay."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.policies.cache.sparsify import MAX_RELAXATIONS, keep_ratios, keep_tokens, kept_slots, relaxed, within_bound


def test_each_layer_keeps_what_is_not_sparse_but_never_less_than_the_floor():
    # CaR Fig. 4's shape: ~60% sparse in the first layer rising to ~95%.
    assert keep_ratios([0.6, 0.8, 0.95], floor=0.1) == pytest.approx([0.4, 0.2, 0.1])
    assert keep_ratios([0.6, 0.8, 0.95], floor=0.25) == pytest.approx([0.4, 0.25, 0.25])
    assert keep_ratios([0.0], floor=0.25) == [1.0]


def test_relaxing_keeps_half_of_what_was_dropped():
    assert relaxed([0.25, 0.5, 1.0]) == pytest.approx([0.625, 0.75, 1.0])
    assert relaxed(relaxed([0.0 + 0.2])) == pytest.approx([0.8])


def test_keep_tokens_rounds_up_to_whole_tokens_of_a_block():
    assert keep_tokens([0.25, 0.4, 1.0, 0.01], block_size=16) == [4, 7, 16, 1]   # 6.4 -> 7; never zero


def test_the_best_scored_tokens_stay_in_position_order_ties_to_the_later():
    assert kept_slots([0.1, 0.5, 0.2, 0.5, 0.0], keep=2) == [1, 3]
    assert kept_slots([0.1, 0.5, 0.2, 0.5, 0.0], keep=3) == [1, 2, 3]
    assert kept_slots([0.3, 0.3, 0.3], keep=1) == [2]
    assert kept_slots([float("-inf"), 0.0, 0.1], keep=2) == [1, 2]   # a dropped slot is never taken back


@given(st.lists(st.floats(0, 1), min_size=1, max_size=16), st.integers(1, 16))
def test_kept_slots_are_the_top_scores(scores, keep):
    kept = kept_slots(scores, keep)
    assert len(kept) == min(keep, len(scores)) and kept == sorted(set(kept))
    dropped = set(range(len(scores))) - set(kept)
    assert all(scores[k] >= scores[d] for k in kept for d in dropped)


@pytest.mark.parametrize("bad", [[-0.1], [1.5]])
def test_sparsity_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError, match="sparsity"):
        keep_ratios(bad, floor=0.25)


def test_ratios_outside_zero_to_one_are_refused():
    with pytest.raises(ValueError, match="keep ratios"):
        keep_tokens([0.0], block_size=16)
    with pytest.raises(ValueError, match="floor"):
        keep_ratios([0.5], floor=0)


def test_profiled_ratios_are_relaxed_until_their_cost_is_within_the_bound():
    cost_of = lambda ratios: 1.0 - min(ratios)   # noqa: E731  (dropping costs what is dropped)
    assert within_bound([0.25, 0.5], cost_of, bound=0.2) == (pytest.approx([0.8125, 0.875]), pytest.approx(0.1875), 2)
    assert within_bound([0.5], cost_of, bound=0.5) == ([0.5], 0.5, 0)


def test_ratios_that_never_come_within_the_bound_leave_every_token():
    tried = []
    assert within_bound([0.25, 0.5], lambda r: tried.append(r) or 1.0, bound=0.1) == ([1.0, 1.0], 0.0, MAX_RELAXATIONS)
    assert len(tried) == MAX_RELAXATIONS + 1
