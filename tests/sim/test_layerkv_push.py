"""LayerKV on a prefill engine in push mode: a pushed prompt's KV is written to its decode engine layer by
layer as each step computes it, so the prefill engine keeps every layer of it on the device (the native
scheduler places layer by layer only a prompt with no `push`), though Eq. 4 would keep fewer; the same
requests on the same engines offload layers colocated and in pull mode. Nor does a forecast's shrink
take a pushed prompt's layers between its chunks (its writes read them from the device). No block is
held at the end."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.policies.offload import OffloadPlan
from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.link import KVGeometry
from kvmesh.sim.plan_layers import layerkv_spec
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, poisson

GEOMETRY = KVGeometry(num_layers=4, kv_heads=2, head_dim=64, dtype_bytes=2)
COST = StepCost(a=0.005, b=1e-4, c=1e-4)
# 512 device blocks of 16 tokens, all 4 layers: prompts of 600-1200 tokens (38-75 blocks a layer) at
# 20 a second crowd them. The staging area, Eq. 5 and Eq. 3 and 4's fits are the planner's.
SPEC = layerkv_spec(EngineSpec(num_layers=4, device_blocks=512, cxl_blocks=8000, block_bytes=8192), COST, GEOMETRY)


def served(topology: str, mode: str, engine_id: str, shrink_all: bool = False, spec: EngineSpec = SPEC):
    """The engine's scheduler after the run, and the layers LayerKV asked it to keep of each prompt;
    `shrink_all`: its plans also ask every running request to give up all its device layers (and
    the run checks some were asked while it ran)."""
    cluster = build(Topology.parse(topology), spec, COST, {"layer_offload": "layerkv"}, geometry=GEOMETRY,
                    transfer_mode=mode)
    scheduler, retained, asked = cluster.members[engine_id].engine.scheduler, [], []
    policy = scheduler.policies.layer_offload

    def recorded(inp):
        plan = policy(inp)
        retained.extend(plan.retain.values())
        if shrink_all:
            asked.extend(r.request_id for r in inp.running)
            return OffloadPlan(retain=plan.retain, shrink={r.request_id: 0 for r in inp.running})
        return plan

    scheduler.policies.layer_offload = recorded
    requests = poisson(20, 40, Lengths.parse("uniform:600-1200"), Lengths.parse("32"), seed=1)
    cluster.run(requests)

    assert all(r.finished_at is not None for r in requests)
    for member in cluster.members.values():
        engine = member.engine
        assert (engine.free, engine.blocks.free("cxl")) == (spec.device_blocks, spec.cxl_blocks)
        assert not (engine.held or engine.pulling or engine.running or engine.waiting or engine.swapped)
    assert not cluster.handoffs
    assert asked or not shrink_all
    return scheduler, retained


def test_a_pushed_prompt_keeps_every_layer_on_its_prefill_engine():
    scheduler, retained = served("pd:1:1", "push", "engine-p0")
    assert min(retained) < GEOMETRY.num_layers, "Eq. 4 is meant to keep fewer layers of some prompts"
    assert scheduler.layers_offloaded == {"admitted": 0, "forecast": 0, "restored": 0}


@pytest.mark.parametrize("topology, mode, engine_id", [("colocated:1", "pull", "engine-c0"),
                                                       ("pd:1:1", "pull", "engine-p0")])
def test_under_the_same_pressure_a_colocated_or_pulled_prompt_offloads_layers(topology, mode, engine_id):
    scheduler, retained = served(topology, mode, engine_id)
    assert min(retained) < GEOMETRY.num_layers
    assert scheduler.layers_offloaded["admitted"] > 0


def test_a_forecast_shrink_takes_no_layer_of_a_pushed_prompt():
    # 256 tokens a step: a prompt's chunks span steps, its prefill running when each plan asks for
    # every running request's device layers
    scheduler, _ = served("pd:1:1", "push", "engine-p0", shrink_all=True, spec=replace(SPEC, token_budget=256))
    assert scheduler.layers_offloaded == {"admitted": 0, "forecast": 0, "restored": 0}
