"""NodeIDs name whole prefixes: equal exactly when every token before them is equal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.libs.kvmeta.nodeid import node_ids

tokens = st.lists(st.integers(min_value=0, max_value=2**31), max_size=80)


@given(tokens, tokens)
def test_shared_prefix_blocks_share_ids_and_the_first_difference_changes_every_later_id(a, b):
    ids_a, ids_b = node_ids(a, 8), node_ids(b, 8)
    for i, (x, y) in enumerate(zip(ids_a, ids_b)):
        assert (x == y) == (a[: (i + 1) * 8] == b[: (i + 1) * 8])


def test_only_full_blocks_are_named_and_continuation_matches():
    prompt = list(range(50))
    ids = node_ids(prompt, 16)
    assert len(ids) == 3 and len(ids[0]) == 32
    assert node_ids(prompt[16:], 16, parent=ids[0]) == ids[1:]


def test_models_do_not_share_names():
    assert node_ids([1] * 16, 16, model="a") != node_ids([1] * 16, 16, model="b")


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        node_ids([1, 2], 0)
