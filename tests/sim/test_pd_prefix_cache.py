"""A split request's parts carry its block names through the P/D hand-off, so a pd topology runs a
prefix cache as the native engines do: the prefill engine looks the prompt up and commits its blocks
(they stay cached after the hand-off); the decode engine commits the pulled prompt's blocks when the
pull lands (services/engine/native: Scheduler.pulled commits) but never looks a pull up."""

import pytest

from kvmesh.sim.cache_choice import with_cache
from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.link import KVGeometry, LinkSpec, push
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology

COST = StepCost(a=0.01, b=1e-5, c=1e-4)
SHARED = tuple(f"s{i}" for i in range(4))  # the first turn's prompt: 64 tokens, 4 full blocks of 16


def _turns() -> list[SimRequest]:
    """A conversation's two turns: the second's prompt is the first's (64 tokens), its answer (4) and a
    new message (60): 128 tokens, its first 4 blocks the first turn's."""
    first = SimRequest("t0", 0.0, 64, 4, block_names=SHARED)
    second = SimRequest("t1", 5.0, 128, 4, block_names=(*SHARED, *(f"t{i}" for i in range(4, 8))))
    return [first, second]


def _cluster(cache: str, transfer_mode: str = "pull"):
    spec, policies = with_cache(EngineSpec(), cache)
    return build(Topology(prefill=1, decode=1), spec, COST, policies, routing="least_loaded",
                 transfer_mode=transfer_mode, heartbeat_s=0.0)


@pytest.mark.parametrize("transfer_mode", ["pull", "push"])
def test_a_second_turn_finds_its_history_cached_on_the_prefill_engine(transfer_mode):
    cluster = _cluster("lru", transfer_mode)
    first, second = _turns()
    cluster.run([first, second])
    assert first.finished_at is not None and second.finished_at is not None
    assert (first.num_cached, second.num_cached) == (0, 64)
    prefill = cluster.members["engine-p0"].engine.blocks
    assert (prefill.lookup_blocks, prefill.hit_blocks["device"]) == (4 + 8, 4)
    # the hand-off released the held KV; its blocks stay in the prefix cache, idle
    assert set(prefill.cached) == {*SHARED, "t4", "t5", "t6", "t7"}
    assert all(node.refs == 0 for node in prefill.cached.values())


def test_the_decode_engine_caches_the_pulled_blocks_and_looks_none_up():
    cluster = _cluster("lru")
    first, second = _turns()
    cluster.run([first, second])
    decode = cluster.members["engine-d0"].engine.blocks
    assert set(decode.cached) == {*SHARED, "t4", "t5", "t6", "t7"}
    assert decode.lookup_blocks == 0  # a pull takes the whole prompt's KV


def test_without_a_cache_pd_finds_nothing():
    cluster = _cluster("none")
    first, second = _turns()
    cluster.run([first, second])
    assert (first.num_cached, second.num_cached) == (0, 0)


def test_push_writes_the_cached_blocks_too():
    """The native prefill engine writes every block of the prompt (engine_handoff._pusher), cached or not:
    the second turn's transfer is its 8 blocks' last layer and the link's latency after the prefill."""
    cluster = _cluster("lru", "push")
    first, second = _turns()
    cluster.run([first, second])
    geometry = KVGeometry()
    whole = push(LinkSpec(), geometry, 16, 0, 128)
    assert second.transfer_s == pytest.approx(whole.data_s / geometry.num_layers + whole.latency_s)
