"""CaR's side of the scheduler (III-B): the Shuffled Window, the scores of the nodes its requests
will reuse, and the prefetcher that brings their cxl-tier nodes back to the device just before
they are needed. The decisions are policies/prefill_admission/car.py and policies/cache/; this applies
them, over the native engine's BlockManager or the simulator's count of blocks (sim/prefix_count.py).

Each step, while the `car` admission policy is on, before admission:
- every waiting request's prefix is looked up (how many of its leading blocks are cached on the
  device, how many after them in the cxl tier: its priority class);
- the window is topped up to its size (fill_window), and each request entering it adds
  WINDOW_SCORE to the nodes it will reuse;
- after admission, for the window's requests still waiting with nodes in the cxl tier, fetch(t)
  decides whether to start loading them now: when the soonest running request is predicted to
  finish within the load time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..cache.cached_node import CachedNode
from ..cache.prefetch import fetch
from ..cache.replacement import RUN_SCORE, WINDOW_SCORE
from ..prefill_admission.car import fill_window


@dataclass(frozen=True)
class WindowParams:
    size: int = 8                 # requests in the Shuffled Window
    max_wait_s: float = 2.0       # a request queued this long enters the window before any class


class CachedPrefixes(Protocol):
    """What Reuse asks of the blocks: the prefix cache's nodes, lookups, scores and reloads."""

    cached: dict[str, CachedNode]
    cache_cxl: bool
    layerwise_reload: bool

    def cached_prefix(self, request) -> list[CachedNode]: ...

    def add_score(self, request, nodes: Sequence[CachedNode], amount: int) -> None: ...

    def node_bytes(self, node: CachedNode) -> int: ...

    def reload(self, nodes: Sequence[CachedNode], spare_only: bool = False, layerwise: bool = False) -> int: ...


class Reuse:
    def __init__(self, blocks: CachedPrefixes, params: WindowParams, bandwidth: float = 0.0):
        """`bandwidth`: cxl -> device bytes per second, what a prefetch's load time is read at."""
        self.blocks, self.params, self.bandwidth = blocks, params, bandwidth
        self.prefetched = 0   # nodes the prefetcher brought back, all time

    def before_admission(self, waiting: list, now: float) -> None:
        """Look the waiting requests' prefixes up, top the window up."""
        prefixes = {request.request_id: self.blocks.cached_prefix(request) for request in waiting}
        for request in waiting:
            request.cache_hits = _hits(prefixes[request.request_id])
        entering = set(fill_window([r.view() for r in waiting], self.params.size, now, self.params.max_wait_s))
        for request in waiting:
            if request.request_id in entering:
                request.window_since = now
                self.blocks.add_score(request, prefixes[request.request_id], WINDOW_SCORE)

    def after_admission(self, waiting: list, running: list, now: float, tpop_s: float) -> None:
        """Prefetch for the window's requests still waiting once the step has admitted its own. One
        admitted in this step reloads its cxl-tier nodes at its turn, layer by layer under its
        compute, each layer's copy before its attention (III-C.1); a prefetch is copied under the
        step it begins with (`layerwise_reload`) but waited for by none of its attention, so it is
        only for requests that step does not run."""
        if not self.blocks.cache_cxl:
            return
        running_views = [r.view() for r in running]
        for request in waiting:
            if request.window_since is None:
                continue
            prefix = self.blocks.cached_prefix(request)   # afresh: admission or a prefetch may have moved nodes
            request.cache_hits = _hits(prefix)
            if not request.cache_hits[1]:
                continue
            size = sum(self.blocks.node_bytes(node) for node in prefix[request.cache_hits[0]:])
            if fetch(running_views, now, tpop_s, size, self.bandwidth):
                self.prefetched += self.blocks.reload(prefix, spare_only=True, layerwise=self.blocks.layerwise_reload)
                request.cache_hits = _hits(prefix)   # reloaded nodes changed tier in place

    def admitted(self, request) -> None:
        """The request is sent to run for the first time: RUN_SCORE to the nodes it holds (and
        WINDOW_SCORE, for one admitted without passing through the window)."""
        held = [self.blocks.cached[node_id] for node_id in request.cached_nodes]
        self.blocks.add_score(request, held, RUN_SCORE + (WINDOW_SCORE if request.window_since is None else 0))


def _hits(prefix: list[CachedNode]) -> tuple[int, int]:
    """Leading blocks of a cached prefix on the device, then how many after them (some in the cxl tier)."""
    device = next((i for i, node in enumerate(prefix) if node.tier != "device"), len(prefix))
    return device, len(prefix) - device
