"""Which blocks a transfer moves: scattered the way a serving pool leaves them.

A pool that has served for a while hands out blocks from a free list that requests of mixed
lengths have returned in mixed order, so a new request's blocks come in short runs of adjacent
ids, not one range and not one id at a time. We replay such a history through a FIFO free list (the
engine's allocator, services/engine/kv_pool.py) and take the blocks the next request would get.
The prefill pool and the decode pool each have their own history, so their runs do not line up.
"""

from __future__ import annotations

from collections import deque

import numpy as np

POOL_FACTOR = 4  # the pool holds this many times the transferred blocks


def churned_allocation(num_blocks: int, pool_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """The ids `num_blocks` new blocks get from a pool of `pool_blocks` after a serving history."""
    free = deque(range(pool_blocks))
    live: list[list[int]] = []
    for _ in range(8 * pool_blocks // 64):  # enough requests to turn the free list over several times
        want = int(rng.integers(1, 128))
        while len(free) < want + num_blocks:
            free.extend(live.pop(int(rng.integers(len(live)))))
        live.append([free.popleft() for _ in range(want)])
        if len(live) > 4 and rng.random() < 0.5:
            free.extend(live.pop(int(rng.integers(len(live)))))
    return np.fromiter((free.popleft() for _ in range(num_blocks)), dtype=np.int64, count=num_blocks)


def scattered_blocks(num_blocks: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """(source ids in the prefill pool, destination ids in the decode pool, blocks per pool)."""
    pool_blocks = POOL_FACTOR * num_blocks
    rng = np.random.default_rng(seed)
    return churned_allocation(num_blocks, pool_blocks, rng), churned_allocation(num_blocks, pool_blocks, rng), pool_blocks


def run_count(ids: np.ndarray) -> int:
    """How many runs of consecutive ids the sequence has (1 for a range, len(ids) for no adjacency)."""
    return int(1 + np.count_nonzero(np.diff(ids) != 1)) if len(ids) else 0
