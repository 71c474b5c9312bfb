"""Descriptor arithmetic and coalescing (Segments.coalesced), against the paper's worked example and by property."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.libs.rdma.kvdirect.descriptor import TensorDescriptor, describe
from kvmesh.libs.rdma.kvdirect.puller import reads_carrying
from kvmesh.libs.rdma.work import Segments


def coalesce(remote, local, sizes):
    merged = Segments(local, remote, sizes).coalesced()
    return merged.remote_addrs, merged.local_offsets, merged.lengths

# KVDirect Fig. 5: cache[B][KV][L][H][D], B=10 KV=2 L=16 H=2 D=128, K of all blocks before all V, bf16.
PAPER = TensorDescriptor(name="cache", addr=0x7F06F40000, rkey=1, dims=("B", "KV", "L", "H", "D"),
                         shape=(10, 2, 16, 2, 128), stride=(4096, 40960, 256, 128, 1), itemsize=2)


def test_paper_example_block_8():
    assert PAPER.offset((8, 0, 0, 0, 0)) == 65_536
    assert PAPER.offset((8, 1, 0, 0, 0)) == 147_456  # the paper prints 147453, a typo: 73728 * 2
    offsets, size = PAPER.extents(np.array([8]))
    assert offsets.tolist() == [65_536, 147_456] and size == 8_192


def test_paper_example_blocks_0_and_1_coalesce_per_tensor():
    offsets, size = PAPER.extents(np.array([0, 1]))
    assert offsets.tolist() == [0, 8_192, 81_920, 90_112]
    local, _ = PAPER.extents(np.array([4, 5]))
    merged = coalesce(offsets, local, np.full(4, size))
    assert [m.tolist() for m in merged] == [[0, 81_920], [32_768, 114_688], [16_384, 16_384]]


def test_engine_pool_layout_is_one_piece_per_block():
    pool = torch.zeros(6, 2, 16, 2, 64, dtype=torch.bfloat16)  # services/engine/kv_pool.py
    desc = describe("device", pool, ("B", "KV", "L", "H", "D"), addr=pool.data_ptr(), rkey=9)
    offsets, size = desc.extents(np.array([3, 4, 0]))
    assert size == 2 * 16 * 2 * 64 * 2 and offsets.tolist() == [3 * size, 4 * size, 0]
    assert desc.num_blocks == 6 and desc.same_layout(desc)


def test_size_one_dimensions_do_not_split_a_block():
    pool = torch.zeros(8, 2, 16, 1, 64, dtype=torch.bfloat16)  # one KV head: H has size 1, stride 64 like L
    desc = describe("device", pool, ("B", "KV", "L", "H", "D"), addr=pool.data_ptr(), rkey=9)
    assert desc.piece_bytes() == 4096 and desc.piece_offsets().tolist() == [0]


def test_block_ids_out_of_range_are_refused():
    with pytest.raises(IndexError):
        PAPER.extents(np.array([10]))
    with pytest.raises(IndexError):
        PAPER.extents(np.array([-1]))


def test_descriptor_without_a_block_dimension_is_refused():
    with pytest.raises(ValueError, match="block dimension"):
        TensorDescriptor(name="x", addr=0, rkey=1, dims=("L", "D"), shape=(4, 4), stride=(4, 1), itemsize=2)


def test_only_reads_contiguous_on_both_sides_merge():
    remote = np.array([0, 100, 200, 300, 500])
    local = np.array([0, 100, 250, 350, 450])
    merged = coalesce(remote, local, np.full(5, 100))
    assert [m.tolist() for m in merged] == [[0, 200, 500], [0, 250, 450], [200, 200, 100]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 63)), min_size=1, max_size=80, unique_by=(lambda t: t[0], lambda t: t[1])),
       st.sampled_from([1, 3, 4096]))
def test_coalesced_reads_move_exactly_the_requested_bytes(pairs, size):
    remote = np.array([r for r, _ in pairs]) * size
    local = np.array([l for _, l in pairs]) * size
    r, l, s = coalesce(remote, local, np.full(len(pairs), size))
    wanted = {(int(a) + k, int(b) + k) for a, b in zip(remote, local) for k in range(size)}
    moved = [(int(a) + k, int(b) + k) for a, b, n in zip(r, l, s) for k in range(n)]
    assert len(moved) == len(wanted) and set(moved) == wanted  # every byte once, nothing more
    assert s.sum() == size * len(pairs)
    mergeable = (r[1:] == r[:-1] + s[:-1]) & (l[1:] == l[:-1] + s[:-1])
    assert not mergeable.any()  # and nothing left that could still merge


@settings(max_examples=200, deadline=None)
@given(continues=st.lists(st.booleans(), min_size=1, max_size=40), data=st.data())
def test_a_request_is_credited_the_reads_that_carry_its_pieces(continues, data):
    """Segments 0..n-1 merged into runs (segment i+1 continues i's run when continues[i]); a request
    owning segments begin..end-1 is credited the runs holding any of them, counted by brute force."""
    n = len(continues) + 1
    run_of = np.cumsum([0] + [not c for c in continues])
    starts = np.flatnonzero(np.r_[True, ~np.array(continues)])
    begin = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(begin + 1, n))
    assert reads_carrying(starts, begin, end) == len(set(run_of[begin:end].tolist()))
