"""Push mode in the native engine and in the simulator (issue 31): the same prompt on pd:1:1 push, the
prefill engine computing it in two chunks. The engine's step records (the KV bytes each step wrote)
and the simulator's writes (sim/cluster.py queues each chunk's on the link as its step computes it)
agree step by step: every step of the prompt writes, and the same blocks (a block a chunk completes
written again, cached prefix blocks once, with the first chunk computed)."""

from __future__ import annotations

import pytest

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.policies.views import blocks_for
from kvmesh.sim import cluster as sim_cluster
from kvmesh.sim.cache_choice import with_cache
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.link import KVGeometry
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology

from ..engine.conftest import run_all, tiny_checkpoint  # noqa: F401 (a fixture)
from ..engine.test_push_engine import BUDGET, DecodeSide, engine_with, landed

BLOCK = 16
GEOMETRY = KVGeometry(num_layers=4, kv_heads=2, head_dim=64, dtype_bytes=4)  # the tiny model in float32
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
COST = StepCost(a=1e-3, b=1e-5, c=1e-4)


async def engine_steps(checkpoint, prompt_len: int, cached: int) -> list[tuple[int, int, int]]:
    """(step, first block, end block) of the prompt's blocks each step wrote in every layer, the steps
    counted from the prompt's first: from the bytes in the engine's step records, ending at the blocks
    the prompt has computed after the step."""
    side = await DecodeSide(engine_with(checkpoint)).start()
    try:
        engine = side.engine
        prompt = list(range(300, 300 + prompt_len))
        if cached:  # served before it, whole: its blocks stay cached
            run_all(engine, [prompt[:cached] + [7]], GREEDY)
        push = await side.push(side.reserved(prompt_len))
        request = engine.add("p", prompt, GREEDY, push=push)
        steps = []
        while engine.scheduler.has_work():
            engine.step()
            end = blocks_for(min(request.num_computed, prompt_len), BLOCK)  # the prompt's blocks computed so far
            written = engine.last_pushed_bytes // (GEOMETRY.num_layers * GEOMETRY.block_bytes(BLOCK))
            steps.append((len(steps) + 1, end - written, end))
        assert await landed(push) is None
        assert [f.finish_reason for f in engine.pushes_landed()] == ["length"]
        return steps
    finally:
        await side.close()


def sim_steps(monkeypatch, prompt_len: int, cached: int) -> list[tuple[int, int, int]]:
    """The same from the simulator's prefill engine: the writes each of its steps queued on the link."""
    cluster = sim_cluster.build(Topology.parse("pd:1:1"), with_cache(
        EngineSpec(block_size=BLOCK, num_layers=GEOMETRY.num_layers, device_blocks=1024, token_budget=BUDGET),
        "lru")[0], COST, geometry=GEOMETRY, transfer_mode="push", heartbeat_s=0.0)
    prefill = cluster.members["engine-p0"].engine
    steps, real_push = [], sim_cluster.push

    def push(link, geometry, block_size, computed, n):  # one chunk's writes, as its step ends
        steps.append((prefill.steps + 1, computed // block_size, blocks_for(computed + n, block_size)))
        return real_push(link, geometry, block_size, computed, n)

    monkeypatch.setattr(sim_cluster, "push", push)
    names = tuple(f"b{i}" for i in range(prompt_len // BLOCK))
    requests = [SimRequest("p", 10.0, prompt_len, 3, block_names=names)]
    if cached:  # served before it, whole (one output token) on the prefill engine
        requests.insert(0, SimRequest("c", 0.0, cached + 1, 1, block_names=names[:cached // BLOCK]))
    cluster.run(requests)
    assert requests[-1].finished_at is not None and requests[-1].num_cached == cached
    first = steps[0][0]
    return [(step - first + 1, *blocks) for step, *blocks in steps]


@pytest.mark.parametrize("prompt_len,cached", [(50, 0), (80, 32)], ids=["two chunks", "a cached prefix"])
async def test_the_engine_and_the_simulator_write_the_same_blocks_in_the_same_steps(
        tiny_checkpoint, monkeypatch, prompt_len, cached):  # noqa: F811 (the fixture)
    """50 tokens: 40 then 10, blocks 0-2 then 2-3 (2 completed, written again). 80 tokens whose first
    32 are cached: 40 then 8, blocks 0-4 (the cached 0-1 too) then 4."""
    expected = {(50, 0): [(1, 0, 3), (2, 2, 4)], (80, 32): [(1, 0, 5), (2, 4, 5)]}[prompt_len, cached]
    assert await engine_steps(tiny_checkpoint, prompt_len, cached) == expected
    assert sim_steps(monkeypatch, prompt_len, cached) == expected
