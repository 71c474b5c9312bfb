"""The discrete-event core: a simulated clock and a heap of timed events. Events at the same time
come out in the order they were scheduled, so a run is the same for the same inputs."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
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
        events = []
        for time, payload in timed:
            if time < self.now:
                raise ValueError(f"event {kind!r} at {time} is before now ({self.now})")
            events.append(Event(time, self._seq, kind, payload))
            self._seq += 1
        self._later = sorted(self._later + events, reverse=True)

    def pop(self) -> Event:
        """The next event; the clock moves to its time."""
        heap, later = self._heap, self._later
        event = later.pop() if later and (not heap or later[-1] < heap[0]) else heapq.heappop(heap)
        self.now = event.time
        return event

    def __bool__(self) -> bool:
        return bool(self._heap or self._later)
