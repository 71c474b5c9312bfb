"""Decode runs leave the prefix cache as single steps do. The native engine commits a decoding
request's full blocks of generated tokens as they fill (engine.py's step: `blocks.commit` for every
chunk; prefix_cache.py's commit names them); the simulator's single steps do too (SimEngine.complete).
A decode run (sim/decode_run.py) does not commit, so it is never planned on an engine with a prefix
cache (`plan` refuses a scheduler with CaR's Reuse, which every prefix-caching engine has; past that
refusal this test's runs would leave each answer's 2 blocks out): the cached nodes, their depths and
last accesses are the same with runs allowed as without."""

from kvmesh.sim.cache_choice import with_cache
from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology

COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)


def _requests() -> list[SimRequest]:
    """Three requests of a 32-token prompt (2 blocks of 16) and 40 tokens to sample: their answers fill
    2 more blocks each, named after the request."""
    return [SimRequest(f"r{i}", 0.001 * i, 32, 40, block_names=tuple(f"r{i}:{j}" for j in range(4)))
            for i in range(3)]


def _cached(max_run_steps: int) -> tuple[dict, int]:
    spec, policies = with_cache(EngineSpec(), "lru")
    cluster = build(Topology.parse("colocated:1"), spec, COST, policies, max_run_steps=max_run_steps)
    requests = _requests()
    cluster.run(requests)
    assert all(r.finished_at is not None for r in requests)
    engine = cluster.members["engine-c0"].engine
    nodes = {node_id: (node.depth, node.last_access) for node_id, node in engine.blocks.cached.items()}
    return nodes, engine.steps


def test_runs_allowed_leave_the_same_cached_nodes_as_single_steps():
    stepped, steps = _cached(0)
    ran, run_steps = _cached(512)
    assert ran == stepped and run_steps == steps
    assert sorted(stepped) == sorted(f"r{i}:{j}" for i in range(3) for j in range(4))  # answers' blocks too
