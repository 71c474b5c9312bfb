"""The discrete-event core: a simulated clock and a heap of timed events. Events at the same time
come out in the order they were scheduled, so a run is the same for the same inputs."""

from __future__ import annotations

import gc
import heapq
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple


class Event(NamedTuple):
    """A tuple, so the heap compares events in C: by time, then by `seq`, which is unique, so the
    kind and payload are never compared."""

    time: float
    seq: int                          # scheduling order: breaks ties between events at the same time
    kind: str
    payload: Any = None


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[Event] = []
        self._later: list[Event] = []  # `schedule_all`'s, latest first: the heap holds only the others
        self._seq = 0

    def schedule(self, time: float, kind: str, payload: Any = None) -> Event:
        if time < self.now:
            raise ValueError(f"event {kind!r} at {time} is before now ({self.now})")
        event = Event(time, self._seq, kind, payload)
        self._seq += 1
        heapq.heappush(self._heap, event)
        return event

    def schedule_all(self, kind: str, timed: Iterable[tuple[float, Any]]) -> None:
        """An event of `kind` at each (time, payload), as that many `schedule` calls in that order,
        kept in a sorted list beside the heap (a run's arrivals, known at its start: the heap stays
        as deep as the events in flight)."""
        events, seq, new = [], self._seq, tuple.__new__  # Event's own __new__ is a Python call more
        for time, payload in timed:
            if time < self.now:
                raise ValueError(f"event {kind!r} at {time} is before now ({self.now})")
            events.append(new(Event, (time, seq, kind, payload)))
            seq += 1
        self._seq = seq
        self._later = sorted(self._later + events, reverse=True)

    def pop(self) -> Event:
        """The next event; the clock moves to its time."""
        heap, later = self._heap, self._later
        event = later.pop() if later and (not heap or later[-1] < heap[0]) else heapq.heappop(heap)
        self.now = event.time
        return event

    def __bool__(self) -> bool:
        return bool(self._heap or self._later)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: an event loop allocates containers that live
    on (events, token lists, decode runs' step ends), and the collector's passes over them took a tenth
    of a 64-engine cluster's run. After it, what the block left goes to the oldest generation unread
    (freeze, then unfreeze), where a full collection reads it as it reads any old object: without that
    the first young collection after it would read all of it at once."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.disable()
    try:
        yield
    finally:
        if not frozen:  # objects someone else froze stay frozen
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()
