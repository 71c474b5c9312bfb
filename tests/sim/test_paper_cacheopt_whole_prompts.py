"""The scheduler `sim paper cacheopt` runs its vLLM, RLP and S^3 on: vLLM v0's default, no chunked
prefill (EngineSpec.chunked_prefill False). A step either prefills whole prompts of waiting requests
while the running ones' decodes stall, or decodes; a prompt the budget left cannot hold waits whole;
no request is admitted while one is swapped out; and a decode run takes no arrival (its admission
would stall the run's decodes), so runs change how fast it simulates, not what."""

import copy

import pytest

from kvmesh.sim.cluster import MAX_RUN_STEPS, Cluster
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.workload import Lengths, poisson

COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)
WHOLE = EngineSpec(block_size=16, device_blocks=4096, max_num_seqs=8, token_budget=100, chunked_prefill=False)


def shapes(engine: SimEngine, now: float = 0.0) -> list[tuple[str, int]]:
    step = engine.schedule(now)
    engine.complete(step, now)
    return [(r.request_id, n) for r, n in step.chunks]


def test_a_step_prefills_whole_prompts_while_decodes_stall_or_decodes():
    engine = SimEngine(WHOLE, COST)
    for name, prompt in (("a", 30), ("b", 50)):
        engine.add(SimRequest(name, 0.0, prompt, 5))
    assert shapes(engine) == [("a", 30), ("b", 50)]
    engine.add(SimRequest("c", 0.0, 60, 5))  # 60 > the budget's 100 less nothing: it is a step of its own
    engine.add(SimRequest("d", 0.0, 50, 5))  # and d, which would fit beside it, waits behind it (FCFS)
    assert shapes(engine) == [("c", 60)]      # a and b stall
    assert shapes(engine) == [("d", 50)]
    assert shapes(engine) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_a_prompt_is_never_chunked_and_the_chunked_engine_would():
    chunked = SimEngine(EngineSpec(block_size=16, device_blocks=4096, max_num_seqs=8, token_budget=100), COST)
    whole = SimEngine(WHOLE, COST)
    for engine in (chunked, whole):
        engine.add(SimRequest("a", 0.0, 70, 5))
        engine.add(SimRequest("b", 0.0, 70, 5))
    assert shapes(chunked) == [("a", 70), ("b", 30)] and shapes(chunked) == [("a", 1), ("b", 40)]
    assert shapes(whole) == [("a", 70)] and shapes(whole) == [("b", 70)] and shapes(whole) == [("a", 1), ("b", 1)]


def test_nobody_is_admitted_while_a_request_is_swapped_out():
    spec = EngineSpec(block_size=16, device_blocks=6, max_num_seqs=8, token_budget=100, chunked_prefill=False,
                      cxl_blocks=16, block_bytes=1024)
    engine = SimEngine(spec, COST, {"preemption_strategy": "swap"})
    engine.add(SimRequest("a", 0.0, 48, 40))
    engine.add(SimRequest("b", 0.0, 48, 40))
    assert shapes(engine) == [("a", 48), ("b", 48)]       # 3 blocks each: the pool is full
    assert shapes(engine) == [("a", 1)]                   # b, the latest, swapped out for a's 4th block
    assert [r.request_id for r in engine.swapped] == ["b"]
    engine.add(SimRequest("c", 0.0, 8, 5))
    assert shapes(engine) == [("a", 1)] and [r.request_id for r in engine.waiting] == ["c"]


def test_decode_runs_change_how_fast_it_runs_not_what():
    spec = EngineSpec(block_size=16, device_blocks=400, max_num_seqs=32, token_budget=1024, chunked_prefill=False)
    requests = poisson(6.0, 200, Lengths.parse("uniform:16-400"), Lengths.parse("exp:60"), seed=3)

    def run(max_run_steps: int) -> list[tuple]:
        mine = copy.deepcopy(requests)
        Cluster({"engine-c0": ("both", SimEngine(spec, COST))}, max_run_steps=max_run_steps).run(mine)
        return [(r.token_times, r.finished_at, r.preemptions) for r in mine]

    one_at_a_time = run(0)
    assert all(finished is not None for _, finished, _ in one_at_a_time) and run(MAX_RUN_STEPS) == one_at_a_time


def test_layerkv_staging_is_refused_without_chunked_prefill():
    with pytest.raises(ValueError, match="staging_cap"):
        EngineSpec(cxl_blocks=64, block_bytes=1024, staging_cap=8, chunked_prefill=False)


def test_a_request_one_step_could_not_compute_whole_is_refused_rather_than_waiting_for_ever():
    engine = SimEngine(WHOLE, COST)
    assert not engine.add(SimRequest("long", 0.0, 90, 20))  # recomputed at its longest: 110 > 100 tokens
    assert engine.add(SimRequest("short", 0.0, 90, 10))
    assert [r.request_id for r in engine.refused] == ["long"] and shapes(engine) == [("short", 90)]
