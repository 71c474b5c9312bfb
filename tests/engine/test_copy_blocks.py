"""copy_blocks moves exactly the named blocks whatever their layout: consecutive runs (slices), a
consecutive target (a staged layer's load: one gather), a consecutive source (its write-back: one
scatter), or neither (gather then scatter)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.services.engine.block_manager import copy_blocks
from kvmesh.services.engine.kv_pool import BlockShape, KVPool

SHAPE = BlockShape(block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
BLOCKS = 48


def pools() -> tuple[KVPool, KVPool]:
    source, target = KVPool("cxl", BLOCKS, SHAPE), KVPool("device", BLOCKS, SHAPE)
    source.tensor.copy_(torch.arange(source.tensor.numel(), dtype=torch.float32).view_as(source.tensor))
    target.tensor.fill_(-1.0)
    return source, target


def layout(draw, n: int, consecutive: bool) -> list[int]:
    if consecutive:
        first = draw(st.integers(0, BLOCKS - n))
        return list(range(first, first + n))
    return draw(st.permutations(range(BLOCKS)))[:n]


@st.composite
def copies(draw):
    n = draw(st.integers(1, 40))
    return layout(draw, n, draw(st.booleans())), layout(draw, n, draw(st.booleans()))


@settings(max_examples=200, deadline=None)
@given(copies())
def test_copy_blocks_moves_exactly_the_named_blocks(blocks):
    source_blocks, target_blocks = blocks
    source, target = pools()
    copy_blocks(source, source_blocks, target, target_blocks)
    assert torch.equal(target.tensor[target_blocks], source.tensor[source_blocks])
    untouched = sorted(set(range(BLOCKS)) - set(target_blocks))
    assert bool((target.tensor[untouched] == -1.0).all())
