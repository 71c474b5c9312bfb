"""copy_blocks moves exactly the named blocks whatever their layout, by both paths: the C++ kernel
(CPU pools: one memcpy per block, in parallel), and torch's for any device: consecutive runs
(slices), a consecutive target (a staged layer's load: one gather), a consecutive source (its
write-back: one scatter), or neither (gather then scatter). Bad rows get a clear error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.services.engine.native.attention import backend
from kvmesh.services.engine.native.attention.block_copy import copy_rows
from kvmesh.services.engine.kv_blocks import copy_block_rows, BlockShape
from kvmesh.services.engine.native.pool_copy import copy_blocks
from kvmesh.services.engine.native.kv_pool import KVPool

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


def torch_path(source: KVPool, source_blocks: list[int], target: KVPool, target_blocks: list[int]) -> None:
    copy_block_rows(source.tensor, source_blocks, target.tensor, target_blocks)


@pytest.mark.parametrize("copy", [copy_blocks, torch_path], ids=["copy_blocks", "torch"])
@settings(max_examples=200, deadline=None)
@given(blocks=copies())
def test_copy_blocks_moves_exactly_the_named_blocks(copy, blocks):
    source_blocks, target_blocks = blocks
    source, target = pools()
    copy(source, source_blocks, target, target_blocks)
    assert torch.equal(target.tensor[target_blocks], source.tensor[source_blocks])
    untouched = sorted(set(range(BLOCKS)) - set(target_blocks))
    assert bool((target.tensor[untouched] == -1.0).all())


needs_kernel = pytest.mark.skipif(backend("cpu") != "cpp", reason="the C++ kernels did not build here")


@needs_kernel
def test_cpu_pools_copy_through_the_kernel_and_one_tensor_goes_to_torch():
    source, target = pools()
    assert copy_rows(source.tensor, [3, 1], target.tensor, [0, 7])
    assert torch.equal(target.tensor[[0, 7]], source.tensor[[3, 1]])
    # within one pool (copy-on-write) the kernel declines, copying nothing: torch's path does it
    assert not copy_rows(source.tensor, [0], source.tensor, [1])
    copy_blocks(source, [0], source, [1])
    assert torch.equal(source.tensor[1], source.tensor[0])


@needs_kernel
@pytest.mark.parametrize(("source_rows", "target_rows", "error"), [
    ([BLOCKS], [0], "source_rows has row 48 outside"),
    ([0], [-1], "target_rows has row -1 outside"),
    ([0, 1], [0], "2 source rows but 1 target_rows"),
])
def test_the_kernel_refuses_rows_outside_either_pool_and_copies_nothing(source_rows, target_rows, error):
    source, target = pools()
    with pytest.raises(ValueError, match=error):
        copy_rows(source.tensor, source_rows, target.tensor, target_rows)
    assert bool((target.tensor == -1.0).all())


@needs_kernel
def test_the_kernel_refuses_pools_of_another_dtype_or_block_size():
    source, target = pools()
    with pytest.raises(ValueError, match="dtypes differ"):
        copy_rows(source.tensor, [0], target.tensor.double(), [0])
    with pytest.raises(ValueError, match="rows differ in size"):
        copy_rows(source.tensor, [0], torch.zeros(BLOCKS, 3), [0])
