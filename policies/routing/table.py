"""An engine table: the views a routing policy reads, kept by a caller that changes few of them
between two requests (the simulator: a route changes one engine's load, a heartbeat renews them all),
with each role's engines in a heap by load. A policy takes it as any sequence of views; least_loaded
(and conditional through it) read the least loaded engine of a role off its heap, in O(log N) instead
of a scan of every engine, when the scan could not pick another: every engine serves the model asked
about, all share one KV layout, and none is excluded."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from .views import EngineView, RouteQuery


def load_key(engine: EngineView) -> tuple[int, int, int, str]:
    """Sort key: least loaded first (the most free device blocks, then the shortest waiting queue, then
    the fewest running requests, then the smallest id)."""
    load = engine.load
    return -load.free_device_blocks, load.waiting, load.running, engine.id


class EngineTable(Sequence[EngineView]):
    def __init__(self, views: Iterable[EngineView] = ()):
        self.reset(views)

    def reset(self, views: Iterable[EngineView]) -> None:
        """Every engine's view anew."""
        self._source, self._version = self, getattr(self, "_version", 0) + 1
        self._views = list(views)
        self._slots = {view.id: i for i, view in enumerate(self._views)}
        self._keys = {view.id: load_key(view) for view in self._views}  # each engine's, as its view has it now
        # The one model every engine serves when they share one KV layout (else none): what `indexes` asks.
        models = {view.model for view in self._views}
        self._indexed = models if len(models) == 1 and len({view.kv_layout for view in self._views}) == 1 else set()
        self._heaps: dict[str, list[tuple[int, int, int, str]]] = {}
        for view in self._views:
            self._heaps.setdefault(view.role, []).append(self._keys[view.id])
        for heap in self._heaps.values():
            heapq.heapify(heap)

    def update(self, view: EngineView) -> None:
        """A new view of an engine in the table (its id, role, model and layout as before)."""
        self._views[self._slots[view.id]] = view
        self._version += 1
        key = self._keys[view.id] = load_key(view)
        heap = self._heaps[view.role]
        heapq.heappush(heap, key)  # its older key goes when it comes up
        if len(heap) > 2 * len(self._views) + 64:  # older keys below the top never come up: drop them
            heap[:] = [self._keys[v.id] for v in self._views if v.role == view.role]
            heapq.heapify(heap)

    def snapshot(self) -> EngineTable:
        """The table as it is now, for a policy to keep: later updates leave it as it is. It reads the
        table's heaps while the table is as it was taken, and scans its own views after."""
        copy = object.__new__(EngineTable)
        copy.__dict__.update(self.__dict__, _views=self._views.copy())
        return copy

    def get(self, engine_id: str) -> EngineView:
        return self._views[self._slots[engine_id]]

    def indexes(self, query: RouteQuery) -> bool:
        """Whether `least` answers for this query as a scan of the engines would."""
        return not query.exclude and query.model in self._indexed

    def least(self, role: str) -> EngineView | None:
        """The least loaded engine of `role` (by load_key), or None without one."""
        if self._source._version != self._version:  # a snapshot of a table updated since
            return min((view for view in self._views if view.role == role), key=load_key, default=None)
        heap = self._heaps.get(role)
        while heap:
            key = heap[0]
            if self._keys[key[3]] is key:
                return self._views[self._slots[key[3]]]
            heapq.heappop(heap)  # an engine's load before its last update
        return None

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, index):
        return self._views[index]

    def __iter__(self):
        return iter(self._views)
