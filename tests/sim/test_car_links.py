"""The prefix cache's copies on one link each way (sim/cache_links.py, as SimEngine times a cxl tier's),
in closed form: copies queued on a link go back to back, so the second lands after the sum of their
times; a copy in starts once the out link has copied what was queued before it; a step lasts at
least the prefetch begun with it; a turn whose prefetched node has not landed starts computing when
it lands.

One node is LAYERS blocks of BYTES: 2,000 bytes, 2 s out (1,000 B/s), 1 s in (2,000 B/s); a step
computes 0.5 s whatever it holds."""

from __future__ import annotations

import pytest

from kvmesh.sim.cache_links import CacheLinks
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

BLOCK, LAYERS, BYTES = 4, 2, 1000
NODE = LAYERS * BYTES
SPEC = EngineSpec(block_size=BLOCK, num_layers=LAYERS, device_blocks=12, max_num_seqs=1, token_budget=64,
                  cxl_blocks=8, block_bytes=BYTES, swap_out_bytes_per_s=1e3, swap_in_bytes_per_s=2e3,
                  prefix_caching=True, cache_cxl=True, cache_high_water=0.5)
COST = StepCost(a=0.5, b=0.0, c=0.0)


def first_turn(engine: SimEngine) -> None:
    """A 16-token prompt named abcd, served 0 to 0.5 s: 8 of 12 blocks in use, past the high-water
    mark's 6, so the idle offload moves one node (d) out at 0.5 s, on the out link until 2.5 s."""
    engine.add(SimRequest("a", 0.0, 16, 1, block_names=tuple("abcd")))
    step = engine.schedule(0.0)
    engine.complete(step, engine.seconds(step))
    assert {name: node.tier for name, node in engine.blocks.cached.items()} == \
        {"a": "device", "b": "device", "c": "device", "d": "cxl"}
    assert engine.blocks.copied == {"offload_idle": NODE}


def test_a_step_s_room_offload_queues_behind_the_idle_offload_on_the_out_link():
    engine = SimEngine(SPEC, COST, {"cache_policy": "car"})
    first_turn(engine)
    engine.add(SimRequest("u", 1.0, 16, 1))   # 8 blocks: 6 free, one idle node evicted for the rest
    step = engine.schedule(1.0)
    assert engine.blocks.copied["offload"] == NODE
    # Its room lands at 0.5 + 2 + 2 (the idle offload's copy, then its own), then it computes.
    assert engine.seconds(step) == pytest.approx(4.5 - 1.0 + 0.5)


def test_a_prefetch_runs_under_the_step_it_begins_with_which_ends_once_it_lands():
    """At 3 s (d is out since 2.5 s) the prefetcher, nothing running, brings d back for the waiting
    turn t, until 4 s; u, with no history, runs first (CaR's class 1 before class 2; one sequence at
    a time). u's step computes 0.5 s with the prefetch under it, and ends when it lands, as the
    native engine's step settles its copies before it ends; t's turn then finds d on the device."""
    engine = SimEngine(SPEC, COST, {"cache_policy": "car", "prefill_admission": "car"})
    first_turn(engine)
    other, later = SimRequest("u", 2.9, 8, 1), SimRequest("t", 3.0, 17, 1, block_names=tuple("abcd"))
    engine.add(other)
    engine.add(later)
    step = engine.schedule(3.0)
    assert [request for request, _ in step.chunks] == [other]
    assert engine.scheduler.reuse.prefetched == 1 and engine.blocks.copied["prefetch"] == NODE
    assert step.cache_offload_s == 0.0 and engine.seconds(step) == pytest.approx(NODE / 2e3)
    end = 3.0 + engine.seconds(step)
    engine.complete(step, end)

    step = engine.schedule(end)
    assert [request for request, _ in step.chunks] == [later] and later.num_cached == 16
    assert step.cache_offload_s == step.cache_load_s == 0.0   # nothing to reload, nothing in flight
    engine.complete(step, end + engine.seconds(step))
    assert later.token_times == [pytest.approx(3.0 + NODE / 2e3 + 0.5)]


def test_a_turn_holding_a_node_prefetched_by_a_step_that_computed_nothing_waits_for_it():
    """A step that computes nothing takes no time here (the native engine copies its prefetches at
    once, flush_loads): a later step holding the node waits before it computes until it lands."""
    links = CacheLinks(out_bytes_per_s=1e3, in_bytes_per_s=2e3)
    links.at(3.0)
    links.copied("prefetch", NODE, ["d"])
    links.at(3.0)   # the step that prefetched computed nothing
    assert links.waits(["d"]) == (pytest.approx(NODE / 2e3), 0.0)
    assert links.waits(["a"]) == (0.0, 0.0)
    links.at(3.0 + NODE / 2e3)
    assert links.waits(["d"]) == (0.0, 0.0) and links.landing == {}


def test_a_reload_starts_once_the_out_link_has_copied_what_was_queued_before_it():
    """At 1 s a turn holding abcd reloads d (no prefetcher: FCFS), which the idle offload is still
    copying out until 2.5 s: the reload runs 2.5 to 3.5 s, under the step's compute."""
    engine = SimEngine(SPEC, COST, {"cache_policy": "car"})
    first_turn(engine)
    later = SimRequest("t", 1.0, 17, 1, block_names=tuple("abcd"))
    engine.add(later)
    step = engine.schedule(1.0)
    assert later.num_cached == 16 and engine.blocks.copied["load"] == NODE
    assert step.cache_offload_s == 0.0 and engine.seconds(step) == pytest.approx(2.5 + NODE / 2e3 - 1.0)
