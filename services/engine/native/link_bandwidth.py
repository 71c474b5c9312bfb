"""CaR's prefetcher needs the cxl -> device bandwidth: timed here at start, over the engine's own pools.
The Shuffled Window, the scores and the prefetcher are policies/iteration/reuse.py's Reuse, which the
simulator runs too."""

from __future__ import annotations

import time

import numpy as np

from .block_manager import BlockManager
from .pool_copy import copy_blocks


def link_bandwidth(blocks: BlockManager, n: int = 32, repeats: int = 5) -> float:
    """cxl -> device bytes per second, timed at start over `n` blocks (the median of `repeats`)."""
    cxl, device = blocks.pools["cxl"], blocks.device
    n = min(n, cxl.free_count, device.free_count)
    source, target = cxl.allocate(n), device.allocate(n)
    try:
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            copy_blocks(cxl, source, device, target)
            seconds.append(time.perf_counter() - started)
    finally:
        for pool, taken in ((cxl, source), (device, target)):
            for block in taken:
                pool.decref(block)
                pool.release(block)
    return n * device.shape.bytes / max(float(np.median(seconds)), 1e-9)
