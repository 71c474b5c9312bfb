"""Cluster.run's `routed` hook: called with each request once, in arrival order, when it is on its
engine (what bench sim_scale times the arrival window with)."""

from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, poisson


def test_routed_sees_every_request_once_in_arrival_order_on_its_engine():
    requests = poisson(20.0, 60, Lengths.parse("uniform:16-64"), Lengths.parse("exp:20"), seed=1)
    cluster = build(Topology.parse("colocated:3"), EngineSpec(), StepCost(a=0.01, c=1e-3))
    seen = []

    def routed(request):
        engines = [m.engine for m in cluster.members.values()]
        seen.append((request.request_id, any(request in e.waiting or request in e.running for e in engines)))

    cluster.run(requests, routed)
    assert seen == [(r.request_id, True) for r in sorted(requests, key=lambda r: r.arrival)]
