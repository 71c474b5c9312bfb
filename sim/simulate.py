"""The event loop: requests arrive, one engine steps whenever it has work, each step lasting what
the cost model says; arrivals during a step join the next one, as in the native engine's loop."""

from __future__ import annotations

from collections.abc import Iterable

from .engine import SimEngine
from .events import EventQueue
from .request import SimRequest

ARRIVAL, STEP_DONE = "arrival", "step_done"


def simulate(engine: SimEngine, requests: Iterable[SimRequest]) -> float:
    """Run every request through the engine; the simulated time when the last event happened.
    A request the pool can never hold stays unfinished (its finished_at None)."""
    events = EventQueue()
    for request in requests:
        events.schedule(request.arrival, ARRIVAL, request)
    busy = False
    while events:
        event = events.pop()
        if event.kind == ARRIVAL:
            engine.add(event.payload)
        else:
            engine.complete(event.payload, events.now)
            busy = False
        while not busy and engine.has_work():
            step = engine.schedule(events.now)
            if step.chunks:
                events.schedule(events.now + engine.seconds(step), STEP_DONE, step)
                busy = True
            elif not step.preempted:  # nothing fits until something else happens
                break
    return events.now
