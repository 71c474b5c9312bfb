"""What the simulator simulates, pinned: a digest of every request's record (token times, finish,
preemptions, hand-off, scheduled time) and every engine's step count for a few clusters, among them
bench sim_scale's shape (colocated engines at 4 req/s each, ShareGPT-like lengths, conditional
routing, decode runs, heartbeats). Work on the simulator's speed leaves these the same floats. A change
meant to change what is simulated updates the digests it moves, and says so in its commit."""

import hashlib

import pytest

from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, poisson

COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)
SPEC = EngineSpec(block_size=16, num_layers=4, device_blocks=4 * 2048, max_num_seqs=256)


def fingerprint(topology: str, rate: float, count: int, **options) -> str:
    requests = poisson(rate, count, Lengths.parse("lognormal:300:0.8"), Lengths.parse("lognormal:250:0.8"), seed=0)
    cluster = build(Topology.parse(topology), SPEC, COST, **options)
    end = cluster.run(requests)
    records = [(r.request_id, r.token_times, r.finished_at, r.preemptions, r.transfer_s, r.scheduled_at)
               for r in requests]
    steps = sorted((engine_id, member.engine.steps) for engine_id, member in cluster.members.items())
    return hashlib.sha256(repr((records, steps, end)).encode()).hexdigest()[:16]


@pytest.mark.parametrize("topology, rate, count, options, digest", [
    ("colocated:8", 32.0, 1600, {}, "dce58c88454a80ef"),
    ("colocated:8", 32.0, 400, {"max_run_steps": 0}, "d2d663604654ae6b"),
    ("pd:2:4", 12.0, 400, {}, "b23c9bb1b99fdfb5"),
    ("pd:2:4", 12.0, 400, {"transfer_mode": "push", "heartbeat_s": 0.25}, "6acfa862ec8e91b7"),
])
def test_what_is_simulated_stays_the_same(topology, rate, count, options, digest):
    assert fingerprint(topology, rate, count, **options) == digest
