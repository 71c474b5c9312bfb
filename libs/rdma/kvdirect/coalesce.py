"""Coalescing reads (KVDirect section 4.2): adjacent reads merge only when both the remote and the
local byte ranges are contiguous, so one merged read moves exactly the bytes the originals did."""

from __future__ import annotations

import numpy as np


def coalesce(remote: np.ndarray, local: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs of reads in queue order where read i+1 starts where read i ends on both sides."""
    remote, local, sizes = (np.asarray(a, dtype=np.int64) for a in (remote, local, sizes))
    if len(sizes) <= 1:
        return remote, local, sizes
    ends_r, ends_l = remote[:-1] + sizes[:-1], local[:-1] + sizes[:-1]
    starts = np.flatnonzero(np.r_[True, (remote[1:] != ends_r) | (local[1:] != ends_l)])
    return remote[starts], local[starts], np.add.reduceat(sizes, starts)
