"""The shm backend's batched copy: the C++ path (plain and streaming stores) lands exactly the bytes
the Python fallback does, at any alignment, and refuses offsets of the wrong type."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.libs.rdma.shm import copy


@pytest.fixture(scope="module")
def extension():
    module = copy._extension()  # builds once per virtualenv, then loads
    if module is None:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler: the C++ copy cannot be built")
        pytest.fail("the shm backend's C++ copy did not build (see the log)")
    return module


def scatter_list(data) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments that do not overlap on either side, of lengths 1..5000 bytes (both sides of the
    streaming copy's 16-byte alignment and 64-byte body)."""
    lengths = data.draw(st.lists(st.integers(1, 5000), min_size=1, max_size=12))
    gaps = data.draw(st.lists(st.integers(0, 40), min_size=len(lengths), max_size=len(lengths)))
    starts = np.cumsum([0] + [n + g for n, g in zip(lengths, gaps)])[:-1]
    order = data.draw(st.permutations(range(len(lengths))))
    return starts.astype(np.int64), starts[list(order)].astype(np.int64), np.array(lengths, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), streaming=st.booleans())
def test_the_extension_lands_what_the_fallback_does(extension, data, streaming):
    src_offsets, dst_offsets, lengths = scatter_list(data)
    size = int(max((src_offsets + lengths).max(), (dst_offsets + lengths).max()))
    # both bases off 16-byte alignment (by 1 and 3 bytes), so streaming copies need their head
    source = np.random.default_rng(int(lengths.sum())).integers(0, 256, size + 1, dtype=np.uint8)
    expected, got = np.zeros(size, np.uint8), np.zeros(size + 3, np.uint8)
    for d, s, n in zip(dst_offsets, src_offsets, lengths):
        expected[d:d + n] = source[1 + s:1 + s + n]
    extension.copy_segments(got.ctypes.data + 3, dst_offsets, source.ctypes.data + 1, src_offsets, lengths, streaming)
    assert np.array_equal(got[3:], expected) and not got[:3].any()

def test_copy_segments_uses_the_streaming_path_above_the_threshold(extension, monkeypatch):
    monkeypatch.setattr(copy, "STREAMING_BYTES", 0)
    source = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    target = np.zeros_like(source)
    offsets = np.array([4096 * 3 + 5, 17], dtype=np.int64)
    copy.copy_segments(memoryview(target), offsets[::-1].copy(), memoryview(source), offsets, np.array([9000, 4000]))
    assert np.array_equal(target[17:17 + 9000], source[offsets[0]:offsets[0] + 9000])
    assert np.array_equal(target[offsets[0]:offsets[0] + 4000], source[17:17 + 4000])


def test_offsets_of_the_wrong_type_are_refused(extension):
    buffer = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="int64"):
        extension.copy_segments(buffer.ctypes.data, np.zeros(1, np.int32), buffer.ctypes.data,
                                np.zeros(1, np.int64), np.ones(1, np.int64), False)
    with pytest.raises(ValueError, match="differ in length"):
        extension.copy_segments(buffer.ctypes.data, np.zeros(2, np.int64), buffer.ctypes.data,
                                np.zeros(1, np.int64), np.ones(1, np.int64), False)
