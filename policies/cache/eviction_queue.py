"""The idle nodes of a prefix cache in the order the cache policy evicts them.

A cache policy ranks one node at a time (policies/cache/replacement.py); the queue keeps every idle
node in a heap by that rank, so making room costs O(log n) a node evicted, not a sort of every idle
node per allocation (what vLLM's free-block queue and SGLang's leaf heap also avoid). A node is
ranked when it goes idle and again when what the rank reads changes while it is idle (CaR's scores
do); leaving the queue, or a newer rank, leaves its older entries in the heap, stale, skipped when
they come up and dropped when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from kvmesh.policies.views import CachedBlockView

Rank = Callable[[CachedBlockView], Any]   # a sortable key; the lowest is evicted first


class EvictionQueue:
    def __init__(self, rank: Rank):
        self.rank = rank
        self._heap: list[tuple[Any, int, str]] = []
        self._live: dict[str, tuple[int, CachedBlockView]] = {}  # node id -> its current entry's number, its view
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._live

    def put(self, view: CachedBlockView) -> None:
        """Rank an idle node (again, if it is already in the queue)."""
        sequence = next(self._sequence)
        self._live[view.node_id] = sequence, view
        heapq.heappush(self._heap, (self.rank(view), sequence, view.node_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [entry for entry in self._heap if self._current(entry)]
            heapq.heapify(self._heap)

    def discard(self, node_id: str) -> None:
        """The node is no longer idle (or no longer cached)."""
        self._live.pop(node_id, None)

    def pop(self, n: int, accept: Callable[[CachedBlockView], bool] | None = None) -> list[str]:
        """Take out the `n` lowest-ranked nodes (among those `accept` takes, if given; the others stay)."""
        taken: list[str] = []
        passed: list[tuple[Any, int, str]] = []
        while len(taken) < n and self._heap:
            entry = heapq.heappop(self._heap)
            node_id = entry[2]
            if not self._current(entry):
                continue
            if accept is not None and not accept(self._live[node_id][1]):
                passed.append(entry)
                continue
            self.discard(node_id)
            taken.append(node_id)
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return taken

    def use(self, rank: Rank) -> None:
        """Rank every node with `rank` from now on (the policy was switched)."""
        views = [view for _, view in self._live.values()]
        self.rank, self._heap, self._live = rank, [], {}
        for view in views:
            self.put(view)

    def view(self, node_id: str) -> CachedBlockView:
        """The view a queued node was last ranked by."""
        return self._live[node_id][1]

    def _current(self, entry: tuple[Any, int, str]) -> bool:
        """Whether a heap entry is its node's latest (not left stale by a discard or a newer put)."""
        live = self._live.get(entry[2])
        return live is not None and live[0] == entry[1]
