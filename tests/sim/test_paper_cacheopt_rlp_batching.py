"""RLP's batching of like estimated lengths (`like_lengths`, CacheOpt section 5's description of RLP)
as a pure prefill admission order with exact values, and RLP's points in `sim paper cacheopt` built
with it (arrival order as the variation)."""

from types import MappingProxyType

from kvmesh.policies import registry
from kvmesh.policies.prefill_admission import like_lengths
from kvmesh.policies.views import PoolView, RequestView
from kvmesh.sim.hardware import load_deployment
from kvmesh.sim.papers import cacheopt

POOL = PoolView(block_size=32, num_layers=4, free=MappingProxyType({"device": 100}),
                total=MappingProxyType({"device": 100}))


def waiting(request_id, arrival, predicted, max_tokens=1000):
    return RequestView(request_id=request_id, arrival=arrival, prompt_len=10, num_tokens=10, num_computed=0,
                       num_generated=0, max_tokens=max_tokens, blocks_per_layer=0, tier="device",
                       predicted_output_len=predicted)


def test_the_oldest_comes_first_then_the_nearest_estimated_lengths_the_older_at_a_tie():
    queue = [waiting("b", 2.0, 500), waiting("a", 1.0, 300), waiting("c", 3.0, 280), waiting("d", 4.0, 320),
             waiting("e", 5.0, 900), waiting("f", 6.0, None, max_tokens=310)]
    # a (300) is the oldest; f has no prediction, so its max_tokens (310) is its estimate; c and d tie at 20.
    assert like_lengths(queue, [], POOL, 10.0) == ["a", "f", "c", "d", "b", "e"]
    assert like_lengths([], [], POOL, 10.0) == []
    assert registry.resolve("prefill_admission", "like_lengths") is like_lengths


def test_rlp_admits_like_lengths_and_its_variation_in_arrival_order():
    deployment = load_deployment(cacheopt.PROFILE)
    rlp = cacheopt._point(deployment, cacheopt.RLP, "sharegpt", 1.0, 10, 0)
    fcfs = cacheopt._point(deployment, cacheopt.RLP, "sharegpt", 1.0, 10, 0, "RLP in arrival order")
    assert dict(rlp.policies)["prefill_admission"] == "like_lengths"
    assert dict(fcfs.policies) == {**dict(rlp.policies), "prefill_admission": "fcfs"}
    assert all("prefill_admission" not in dict(cacheopt._point(deployment, name, "sharegpt", 1.0, 10, 0).policies)
               for name in cacheopt.METHODS if name != cacheopt.RLP)
