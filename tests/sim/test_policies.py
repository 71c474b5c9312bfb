"""The simulated engine decides by calling policies/ functions by name, with the views it builds."""

import dataclasses

import pytest

from kvmesh.policies import preemption
from kvmesh.policies.allocation import AllocationParams
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.simulate import simulate
from kvmesh.sim.step_cost import StepCost

# Five blocks of 4 tokens. A (prompt 8) runs alone, then B (prompt 5) joins and the pool is full;
# A's 13th token needs a fourth block first: the victim is chosen between B (still to reserve) and A.
SPEC = EngineSpec(block_size=4, device_blocks=5, max_num_seqs=8, token_budget=64)


def squeezed() -> list[SimRequest]:
    return [SimRequest("A", 0.0, 8, 12), SimRequest("B", 1e-4, 5, 8)]


def recorded(function, calls):
    def call(*args):
        calls.append((args, result := function(*args)))
        return result
    return call


@pytest.mark.parametrize("order, victim", [("latest_arrival_first", "B"), ("lkvo", "B"), ("srtf", "A")])
def test_the_preemption_order_policy_picks_the_victim(order, victim):
    engine = SimEngine(SPEC, StepCost(a=1e-3), {"preemption_order": order})
    calls = []
    engine.policies.preemption_order = recorded(engine.policies.preemption_order, calls)
    requests = squeezed()
    simulate(engine, requests)

    (views, pool), answer = calls[0]
    assert sorted(v.request_id for v in views) == ["A", "B"] and pool.free == {"device": 0}
    assert answer == getattr(preemption, order)(views, pool)  # what the function says for those views
    assert engine.preemptions[0][1:] == (answer[0], "recompute") == (victim, "recompute")
    assert all(r.finished_at is not None for r in requests) and engine.free == SPEC.device_blocks


def test_the_admission_policy_orders_the_waiting_requests():
    engine = SimEngine(EngineSpec(max_num_seqs=1), StepCost(a=1e-3))
    calls = []
    engine.policies.prefill_admission = recorded(lambda waiting, *_: sorted(r.request_id for r in waiting)[::-1],
                                                 calls)
    requests = [SimRequest(f"r{i}", i * 1e-4, 4, 1) for i in range(4)]
    simulate(engine, requests)
    # r0 starts alone; the others wait and go in the order the policy gave: r3, r2, r1.
    assert [r.request_id for r in sorted(requests, key=lambda r: r.finished_at)] == ["r0", "r3", "r2", "r1"]
    assert calls


def test_a_request_the_pool_can_never_hold_is_refused():
    engine = SimEngine(SPEC, StepCost(a=1e-3))
    requests = [SimRequest("big", 0.0, 8, 13), SimRequest("small", 0.0, 8, 4)]
    simulate(engine, requests)
    assert engine.refused == [requests[0]] and requests[0].finished_at is None
    assert requests[1].finished_at is not None


def test_the_allocation_policy_allots_ahead_through_the_ledger():
    engine = SimEngine(SPEC, StepCost(a=1e-3), {"kv_allocation": "cacheopt"},
                       AllocationParams(block_tokens=2, embed_buffer=2, reserved_blocks=0))
    calls = []
    engine.policies.kv_allocation = recorded(engine.policies.kv_allocation, calls)
    requests = squeezed()
    simulate(engine, requests)
    granted = {grant.request_id: grant.tokens for _, plan in calls for grant in plan.grants}
    assert granted.keys() == {"A", "B"} and all(tokens for tokens in granted.values())
    assert all(r.finished_at is not None and r.allocation is None for r in requests)
    assert engine.free == SPEC.device_blocks


def test_the_preemption_strategy_policy_swaps_to_the_cxl_tier():
    spec = dataclasses.replace(SPEC, cxl_blocks=8, block_bytes=1024)
    engine = SimEngine(spec, StepCost(a=1e-3), {"preemption_strategy": "swap"})
    requests = squeezed()
    simulate(engine, requests)
    assert [how for _, _, how in engine.preemptions] == ["swap"]
    assert all(r.finished_at is not None for r in requests) and engine.free == SPEC.device_blocks
    assert engine.blocks.free("cxl") == 8 and engine.blocks.moved["cxl"] == engine.blocks.moved["device"] > 0


def test_unknown_and_unsimulated_policies_are_refused():
    with pytest.raises(KeyError):
        SimEngine(SPEC, StepCost(a=1e-3), {"preemption_order": "nobody"})
    with pytest.raises(ValueError, match="needs a staging area"):
        SimEngine(SPEC, StepCost(a=1e-3), {"layer_offload": "layerkv"})
