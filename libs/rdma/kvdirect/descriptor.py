"""Tensor descriptors: how a peer turns a block id into the bytes it reads (KVDirect section 4.1).

A descriptor names each dimension (e.g. B, KV, L, H, D), gives its shape and its stride in elements,
and the element size. A block's pieces start at dot(index, stride) * itemsize; each piece covers the
densely packed inner dimensions, found from the smallest stride upwards, so a layout that keeps a
block's K and V together is one piece per block and one that stores all K before all V is two.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated

import msgspec
import numpy as np

BLOCK_DIM = "B"
# Bounds a peer's descriptor is held to before anything is computed from it: a block's pieces are
# enumerated (piece_offsets), so a descriptor claiming billions of them would hang its reader.
MAX_DIMS = 8
MAX_PIECES = 1 << 16
MAX_EXTENT = 1 << 48   # bytes a tensor may span
Dimension = Annotated[int, msgspec.Meta(ge=1, le=MAX_EXTENT)]


class TensorDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(max_length=128)]
    addr: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # of element 0, in the owner's address space
    rkey: Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
    dims: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=16)], ...], msgspec.Meta(max_length=MAX_DIMS)]
    shape: Annotated[tuple[Dimension, ...], msgspec.Meta(max_length=MAX_DIMS)]
    stride: Annotated[tuple[Dimension, ...], msgspec.Meta(max_length=MAX_DIMS)]  # in elements
    itemsize: Annotated[int, msgspec.Meta(ge=1, le=16)]

    def __post_init__(self) -> None:
        if not (len(self.dims) == len(self.shape) == len(self.stride)):
            raise ValueError(f"descriptor {self.name}: dims, shape and stride differ in length")
        if BLOCK_DIM not in self.dims:
            raise ValueError(f"descriptor {self.name}: no block dimension {BLOCK_DIM!r} in {self.dims}")
        if self.itemsize <= 0 or min(self.shape) <= 0 or min(self.stride) <= 0:
            raise ValueError(f"descriptor {self.name}: shape, stride and itemsize must be positive")
        if sum((n - 1) * s for n, s in zip(self.shape, self.stride)) * self.itemsize >= MAX_EXTENT:
            raise ValueError(f"descriptor {self.name}: spans more than {MAX_EXTENT} bytes")
        if math.prod(self.shape[d] for d in _dense_inner(self)[1]) > MAX_PIECES:
            raise ValueError(f"descriptor {self.name}: more than {MAX_PIECES} pieces a block")

    @property
    def num_blocks(self) -> int:
        return self.shape[self.dims.index(BLOCK_DIM)]

    def offset(self, index: tuple[int, ...]) -> int:
        """Byte offset of the element at `index`: the dot product of index and stride."""
        return int(np.dot(index, self.stride)) * self.itemsize

    def piece_bytes(self) -> int:
        """Bytes in one contiguous piece of a block."""
        return _dense_inner(self)[0] * self.itemsize

    def piece_offsets(self) -> np.ndarray:
        """Byte offsets of a block's pieces relative to the block's start (length 1 when it is dense)."""
        _, outer = _dense_inner(self)
        ranges = [range(self.shape[d]) for d in outer]
        return np.array([sum(i * self.stride[d] for i, d in zip(combo, outer)) * self.itemsize
                         for combo in itertools.product(*ranges)], dtype=np.int64)

    def extents(self, blocks: np.ndarray) -> tuple[np.ndarray, int]:
        """Byte offsets of every piece of `blocks` and the piece size. Piece-major (all blocks' K, then
        all blocks' V when they are apart), so adjacent blocks' pieces are neighbours in the list."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise IndexError(f"descriptor {self.name}: block ids must be in [0, {self.num_blocks})")
        block_stride = self.stride[self.dims.index(BLOCK_DIM)] * self.itemsize
        offsets = (self.piece_offsets()[:, None] + blocks[None, :] * block_stride).reshape(-1)
        return offsets, self.piece_bytes()

    def same_layout(self, other: TensorDescriptor) -> bool:
        """Whether blocks of `other` have the pieces of ours (so a block can be read into one of theirs)."""
        return self.piece_bytes() == other.piece_bytes() and np.array_equal(self.piece_offsets(), other.piece_offsets())


def describe(name: str, tensor, dims: tuple[str, ...], addr: int, rkey: int) -> TensorDescriptor:
    """The descriptor of a (CPU or device) torch tensor registered at `addr` with `rkey`."""
    return TensorDescriptor(name=name, addr=addr, rkey=rkey, dims=tuple(dims), shape=tuple(tensor.shape),
                            stride=tuple(tensor.stride()), itemsize=tensor.element_size())


def _dense_inner(desc: TensorDescriptor) -> tuple[int, list[int]]:
    """(elements in the dense run of inner dimensions, the other inner dimensions)."""
    # A dimension of size 1 adds no bytes and its stride is arbitrary (torch keeps any), so skip it.
    inner = sorted((d for d, name in enumerate(desc.dims) if name != BLOCK_DIM and desc.shape[d] > 1),
                   key=lambda d: desc.stride[d])
    run, dense = 1, 0
    for d in inner:
        if desc.stride[d] != run:
            break
        run *= desc.shape[d]
        dense += 1
    return run, inner[dense:]
