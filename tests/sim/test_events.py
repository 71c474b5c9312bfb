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


def test_events_scheduled_all_at_once_interleave_with_the_others_by_time_then_scheduling_order():
    events = EventQueue()
    events.schedule(1.0, "first")
    events.schedule_all("arrival", [(2.0, "b"), (1.0, "a"), (2.0, "c")])
    events.schedule(1.0, "after a")
    seen = []
    while events:
        event = events.pop()
        seen.append((event.time, event.kind, event.payload))
        if event.payload == "b":
            events.schedule(2.0, "after c")
    assert seen == [(1.0, "first", None), (1.0, "arrival", "a"), (1.0, "after a", None), (2.0, "arrival", "b"),
                    (2.0, "arrival", "c"), (2.0, "after c", None)]
    with pytest.raises(ValueError):
        events.schedule_all("late", [(1.5, None)])
