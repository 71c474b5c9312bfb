"""CaR's side of the scheduler (III-B): the Shuffled Window, the scores of the nodes its requests
will reuse, and the prefetcher that brings their cxl-tier nodes back to the device just before
they are needed. The decisions are policies/prefill_admission/car.py and policies/cache/; this applies them.

Each step, before admission, while the `car` admission policy is on:
- every waiting request's prefix is looked up (how many of its leading blocks are cached on the
  device, how many after them in the cxl tier: its priority class);
- the window is topped up to its size (fill_window), and each request entering it adds
  WINDOW_SCORE to the nodes it will reuse;
- for the window's requests with nodes in the cxl tier, fetch(t) decides whether to start loading
  them now: when the soonest running request is predicted to finish within the load time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvmesh.policies.cache.prefetch import fetch
from kvmesh.policies.cache.replacement import RUN_SCORE, WINDOW_SCORE
from kvmesh.policies.prefill_admission.car import fill_window

from .block_manager import BlockManager, CachedNode
from .pool_copy import copy_blocks
from .request import Request


@dataclass(frozen=True)
class WindowParams:
    size: int = 8                 # requests in the Shuffled Window
    max_wait_s: float = 2.0       # a request queued this long enters the window before any class


class Reuse:
    def __init__(self, blocks: BlockManager, params: WindowParams):
        self.blocks, self.params = blocks, params
        self.bandwidth = link_bandwidth(blocks) if blocks.cache_cxl else 0.0  # cxl -> device, bytes/s
        self.prefetched = 0   # nodes the prefetcher brought back, all time

    def before_admission(self, waiting: list[Request], running: list[Request], now: float, tpop_s: float):
        """Look the waiting requests' prefixes up, top the window up, prefetch."""
        prefixes = {request.request_id: self.blocks.cached_prefix(request) for request in waiting}
        for request in waiting:
            request.cache_hits = _hits(prefixes[request.request_id])
        entering = set(fill_window([r.view() for r in waiting], self.params.size, now, self.params.max_wait_s))
        for request in waiting:
            if request.request_id in entering:
                request.window_since = now
                self.blocks.add_score(request, prefixes[request.request_id], WINDOW_SCORE)
        if not self.blocks.cache_cxl:
            return
        running_views = [r.view() for r in running]
        for request in waiting:
            if request.window_since is None or not request.cache_hits[1]:
                continue
            size = sum(self.blocks.node_bytes(node) for node in prefixes[request.request_id][request.cache_hits[0]:])
            if fetch(running_views, now, tpop_s, size, self.bandwidth):
                prefix = self.blocks.cached_prefix(request)   # afresh: an earlier prefetch may have moved nodes
                self.prefetched += self.blocks.reload(prefix, spare_only=True)
                request.cache_hits = _hits(prefix)   # reloaded nodes changed tier in place

    def admitted(self, request: Request) -> None:
        """The request is sent to run for the first time: RUN_SCORE to the nodes it holds (and
        WINDOW_SCORE, for one admitted without passing through the window)."""
        held = [self.blocks.cached[node_id] for node_id in request.cached_nodes]
        self.blocks.add_score(request, held, RUN_SCORE + (WINDOW_SCORE if request.window_since is None else 0))


def _hits(prefix: list[CachedNode]) -> tuple[int, int]:
    """Leading blocks of a cached prefix on the device, then how many after them (some in the cxl tier)."""
    device = next((i for i, node in enumerate(prefix) if node.tier != "device"), len(prefix))
    return device, len(prefix) - device


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
