"""The shm backend's copy of a scatter list: the C++ batched copy (csrc/copy_segments.cpp) when it
builds, else one memoryview slice assignment per segment. Setup builds it once with
`python -m kvmesh.libs.rdma.shm.copy`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

from kvmesh.libs import native

NAME = "kvmesh_shm_copy"
SOURCES = (Path(__file__).parent / "csrc" / "copy_segments.cpp",)

# A transfer this large no longer fits the cache share of one core, so it is written with streaming
# stores (measured crossover on the 2-core VM: tie at 32 MiB, +35% at 64 MiB). KVMESH_SHM_STREAMING_BYTES
# overrides it for other machines.
STREAMING_BYTES = int(os.environ.get("KVMESH_SHM_STREAMING_BYTES", 32 << 20))


@functools.cache
def _extension() -> ModuleType | None:
    return native.load(NAME, SOURCES)


def copy_segments(dst: memoryview, dst_offsets: np.ndarray, src: memoryview, src_offsets: np.ndarray,
                  lengths: np.ndarray) -> None:
    """dst[dst_offsets[i] : +lengths[i]] = src[src_offsets[i] : +lengths[i]] for every i; the
    offsets are already checked against both buffers."""
    extension = _extension()
    if extension is not None:
        total = int(lengths.sum())
        extension.copy_segments(_address(dst), dst_offsets, _address(src), src_offsets, lengths, total > STREAMING_BYTES)
        return
    for d, s, n in zip(dst_offsets.tolist(), src_offsets.tolist(), lengths.tolist()):
        dst[d:d + n] = src[s:s + n]


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if _extension() is not None else 1)
