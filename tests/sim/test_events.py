"""The event core: time order, ties in scheduling order, a clock that only moves forward."""

import pytest

from kvmesh.sim.events import EventQueue


def test_events_come_out_in_time_order_and_ties_in_scheduling_order():
    events = EventQueue()
    for time, kind in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")]:
        events.schedule(time, kind)
    seen = []
    while events:
        event = events.pop()
        seen.append((events.now, event.kind))
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]


def test_an_event_before_now_is_refused():
    events = EventQueue()
    events.schedule(1.0, "a")
    events.pop()
    with pytest.raises(ValueError):
        events.schedule(0.5, "late")
