"""The event core: time order, ties in scheduling order, a clock that only moves forward."""

import gc

import pytest

from kvmesh.sim.events import EventQueue, collector_paused


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


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_in_a_paused_block_and_as_it_was_after_with_what_it_made_in_the_oldest_generation(
        enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
            made = [[i] for i in range(5000)]
        assert gc.isenabled() == enabled
        assert gc.get_count()[0] < 5000 and gc.get_freeze_count() == 0
        assert all(gc.is_tracked(item) for item in made)  # still the collector's to read, in a full collection
    finally:
        (gc.enable if was else gc.disable)()


def test_a_paused_block_leaves_objects_someone_else_froze_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector_paused():
            [[i] for i in range(100)]
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
