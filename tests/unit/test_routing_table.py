"""An EngineTable (policies/routing/table.py) makes least_loaded and conditional read the least
loaded engine off a heap; what they pick is what a scan of the same views picks, through any run of
updates, for every mix of roles, and wherever the table cannot answer (an exclusion, another model
or KV layout among the engines) they scan."""

from __future__ import annotations

import random

import pytest

from kvmesh.policies.routing.conditional import conditional
from kvmesh.policies.routing.least_loaded import least_loaded
from kvmesh.policies.routing.table import EngineTable
from kvmesh.policies.routing.views import EngineLoad, EngineView, RouteQuery, RoutingState

QUERY = RouteQuery("m", 100)


def view(engine_id: str, role: str, rng: random.Random, model: str = "m", layout: tuple = (16, 1)) -> EngineView:
    load = EngineLoad(free_device_blocks=rng.randrange(0, 40, 4), total_device_blocks=40, waiting=rng.randrange(3),
                      running=rng.randrange(3))
    return EngineView(id=engine_id, role=role, model=model, load=load, block_size=16, kv_layout=layout)


@pytest.mark.parametrize("roles", [{"both": 7}, {"prefill": 3, "decode": 5}, {"prefill": 2}, {"decode": 3},
                                   {"prefill": 2, "decode": 2, "both": 3}])
@pytest.mark.parametrize("policy", [least_loaded, conditional])
def test_the_table_picks_what_a_scan_picks_through_updates(roles, policy):
    rng = random.Random(7)
    views = [view(f"e-{role}{i}", role, rng) for role, n in roles.items() for i in range(n)]
    table = EngineTable(views)
    for _ in range(200):
        assert policy(QUERY, table.snapshot(), RoutingState()) == policy(QUERY, list(table), RoutingState())
        changed = view(rng.choice(views).id, "", rng)
        table.update(EngineView(changed.id, table.get(changed.id).role, "m", changed.load, 16, kv_layout=(16, 1)))


def test_a_snapshot_keeps_the_views_it_was_taken_with():
    rng = random.Random(1)
    table = EngineTable([view("a", "both", rng), view("b", "both", rng)])
    before = table.snapshot()
    kept = list(before)
    table.update(EngineView("a", "both", "m", EngineLoad(0, 40, 9, 9), 16, kv_layout=(16, 1)))
    assert list(before) == kept and table.get("a").load.waiting == 9


@pytest.mark.parametrize("query, other", [(RouteQuery("m", 100, exclude=frozenset({"e-both0"})), {}),
                                          (QUERY, {"model": "n"}), (QUERY, {"layout": (32, 1)})])
def test_where_the_table_cannot_answer_the_policy_scans(query, other):
    rng = random.Random(3)
    views = [view(f"e-both{i}", "both", rng) for i in range(4)] + [view("x", "both", rng, **other)]
    table = EngineTable(views)
    assert not table.indexes(query)
    assert least_loaded(query, table.snapshot(), RoutingState()) == least_loaded(query, views, RoutingState())


def test_a_snapshot_asked_after_the_table_moved_on_scans_its_own_views_and_leaves_the_table_as_it_is():
    """Engine e5 becomes the least loaded after the snapshot: the snapshot still picks what it was
    taken with, and the table e5 (reading the shared heap by its old views would drop e5's new key)."""
    rng = random.Random(5)
    table = EngineTable([view(f"e{i}", "both", rng) for i in range(6)])
    old = table.snapshot()
    least = old.least("both")
    assert least.id != "e5"
    table.update(EngineView("e5", "both", "m", EngineLoad(40, 40, 0, 0), 16, kv_layout=(16, 1)))
    assert old.least("both") == least
    assert table.least("both").id == "e5"


def test_the_heap_keeps_no_more_than_a_bounded_count_of_old_keys():
    """An engine whose load improves leaves its older key deep in the heap, where it never comes up:
    the table drops such keys once they outnumber the engines, and still picks what a scan picks."""
    rng = random.Random(3)
    views = [view(f"e{i}", "both", rng) for i in range(4)]
    table = EngineTable(views)
    for _ in range(1000):
        engine = view(f"e{rng.randrange(4)}", "both", rng)
        table.update(engine)
        views = [engine if v.id == engine.id else v for v in views]
        assert len(table._heaps["both"]) <= 2 * len(views) + 65
        assert table.least("both") == min(views, key=lambda v: (-v.load.free_device_blocks, v.load.waiting,
                                                                 v.load.running, v.id))
