"""A prefill engine's link shared by its pairs: concurrent transfers split its bandwidth (processor
sharing), each keeps its own per-read time, a pair's own transfers still go one after another, and
two prefill engines' links are apart. Closed forms, then through the cluster."""

import pytest

from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.link import KVGeometry, LinkSpec, pull, push
from kvmesh.sim.request import SimRequest
from kvmesh.sim.shared_link import SharedLink
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, poisson

GEOMETRY = KVGeometry(num_layers=4, kv_heads=2, head_dim=64, dtype_bytes=2)
LINK = LinkSpec(gbps=2.0, latency_us=500.0, per_read_us=10.0)
TRANSFER = pull(LINK, GEOMETRY, 16, 100)  # 229 KB: 4 reads (40 us) and 115 us of bytes
READS = TRANSFER.data_s - TRANSFER.bytes_s


def test_two_equal_pulls_starting_together_each_take_twice_the_bandwidth_part():
    link = SharedLink()
    assert link.add(1.0, [("d0", "a", TRANSFER, [1.0])]) == [("a", 1.0 + TRANSFER.data_s)]  # link.py's price
    shared = 1.0 + READS + 2 * TRANSFER.bytes_s
    assert dict(link.add(1.0, [("d1", "b", TRANSFER, [1.0])])) == pytest.approx({"a": shared, "b": shared}, rel=1e-12)
    together = SharedLink().add(1.0, [("d0", "a", TRANSFER, [1.0]), ("d1", "b", TRANSFER, [1.0])])
    assert dict(together) == pytest.approx({"a": shared, "b": shared}, rel=1e-12)  # queued at once: the same


def test_a_pull_starting_halfway_through_another_slows_it_from_there():
    """Alone, a is half done at d / 2 (its reads and part of its bytes: d / 2 left, all bytes). Shared,
    it ends d / 2 x 2 later, at 3d / 2; b by then has had its reads and d - READS at half speed, so
    b - (d - READS) / 2 of bytes left, which it moves alone."""
    d, b = TRANSFER.data_s, TRANSFER.bytes_s
    link = SharedLink()
    link.add(0.0, [("d0", "a", TRANSFER, [0.0])])
    landed = dict(link.add(d / 2, [("d1", "b", TRANSFER, [d / 2])]))
    assert landed["a"] == pytest.approx(3 * d / 2, rel=1e-12)
    assert landed["b"] == pytest.approx(3 * d / 2 + b - (d - READS) / 2, rel=1e-12)


def test_a_transfer_queued_behind_its_pairs_own_waits_for_it_and_then_runs_alone():
    """a then c on d0 (first come, first served), b on d1: a and b share from 0 and both land at
    READS + 2B; c starts then, alone."""
    link = SharedLink()
    link.add(0.0, [("d0", "a", TRANSFER, [0.0])])
    link.add(0.0, [("d0", "c", TRANSFER, [0.0])])
    landed = dict(link.add(0.0, [("d1", "b", TRANSFER, [0.0])]))
    both = READS + 2 * TRANSFER.bytes_s
    assert landed == pytest.approx({"a": both, "b": both, "c": both + TRANSFER.data_s}, rel=1e-12)


def test_a_transfer_that_ends_before_another_starts_is_not_slowed():
    link = SharedLink()
    link.add(0.0, [("d0", "a", TRANSFER, [0.0])])
    later = TRANSFER.data_s
    assert link.add(later, [("d1", "b", TRANSFER, [later])]) == [("b", 2 * TRANSFER.data_s)]


def test_pushes_to_two_decode_engines_share_each_layers_writes():
    """A step of 0.1 ms computing 4 layers (the link slower than the layers): alone, the last write lands
    T / L + L w after the start; two such chunks to two decode engines write side by side, each
    layer's w taking w + its bytes."""
    transfer, layers, step_s = push(LINK, GEOMETRY, 16, 0, 100), GEOMETRY.num_layers, 1e-4
    w, w_bytes = transfer.data_s / layers, transfer.bytes_s / layers
    releases = [step_s * layer / layers for layer in range(1, layers + 1)]
    link = SharedLink()
    [(_, alone)] = link.add(0.0, [("d0", "a", transfer, releases)])
    assert alone == pytest.approx(step_s / layers + layers * w, rel=1e-12)
    landed = dict(link.add(0.0, [("d1", "b", transfer, releases)]))
    assert landed == pytest.approx({"a": step_s / layers + layers * (w + w_bytes),
                                    "b": step_s / layers + layers * (w + w_bytes)}, rel=1e-12)


COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)
SPEC = EngineSpec(block_size=16, device_blocks=256, token_budget=2048)


def transfers(topology: str, requests: list[SimRequest], **options) -> list[float]:
    cluster = build(Topology.parse(topology), SPEC, COST, routing="round_robin", link=LINK, geometry=GEOMETRY,
                    heartbeat_s=0.0, **options)
    cluster.run(requests)
    assert all(request.finished_at is not None for request in requests)
    return [request.transfer_s for request in requests]


def together() -> list[SimRequest]:
    """x (one output token: served whole on its prefill engine) keeps p0 busy while a and b arrive, so
    p0 prefills a and b in one step; round robin sends x, a and b to decode engines d0, d1, d0."""
    return [SimRequest("x", 0.0, 16, 1), SimRequest("a", 0.0, 100, 4), SimRequest("b", 0.0, 100, 4)]


def test_two_pulls_from_one_prefill_engine_share_it_and_from_two_do_not():
    """On pd:1:2 a's and b's decode engines pull from p0 at once, side by side; on pd:2:2 a is on p1,
    b on p0, each alone."""
    shared = TRANSFER.seconds + TRANSFER.bytes_s
    assert transfers("pd:1:2", together())[1:] == pytest.approx([shared, shared], rel=1e-9)
    assert transfers("pd:2:2", together())[1:] == pytest.approx([TRANSFER.seconds, TRANSFER.seconds], rel=1e-9)


def test_pushes_through_one_prefill_engine_share_it():
    """Pushed, a's and b's chunks are written layer by layer as p0's step computes them, to two decode
    engines: each layer's write takes its bytes twice, so the last one, after the step, lands one
    layer's bytes later than alone (pd:2:2)."""
    alone = transfers("pd:2:2", together(), transfer_mode="push")[1:]
    assert alone[0] == pytest.approx(alone[1], rel=1e-12)
    shared = transfers("pd:1:2", together(), transfer_mode="push")[1:]
    bytes_per_layer = push(LINK, GEOMETRY, 16, 0, 100).bytes_s / GEOMETRY.num_layers
    assert shared == pytest.approx([alone[0] + bytes_per_layer] * 2, rel=1e-9)


def test_overlapping_pulls_of_a_loaded_cluster_take_longer_than_alone():
    """300 prompts of 64-512 tokens at 20 a second (p0 busy about 60% of the time). On pd:1:3 each
    prompt's decode engine is the next of three, all pulling from p0: transfers overlap, and took 1.30
    times their alone price (1.03 with a link per pair, the model before). pd:3:3 under round robin
    pairs each prefill engine with one decode engine, so nothing shares: the alone price."""
    def over_alone(topology: str) -> float:
        requests = poisson(20.0, 300, Lengths.parse("uniform:64-512"), Lengths.parse("8"), seed=3)
        taken = transfers(topology, requests)
        alone = [pull(LINK, GEOMETRY, 16, request.prompt_len).seconds for request in requests]
        assert all(t >= a * (1 - 1e-9) for t, a in zip(taken, alone))
        return sum(taken) / sum(alone)

    assert over_alone("pd:1:3") > 1.2
    assert over_alone("pd:3:3") == pytest.approx(1.0, rel=1e-9)


def test_the_link_is_busy_until_the_sum_of_the_work_and_queueing_at_once_or_one_by_one_agrees():
    """Without per-read time the shared link moves bytes at its full bandwidth whenever any pair has
    a transfer: 12 transfers on 4 pairs queued at 0 land last at the sum of their times; each pair's
    land in their order; queued one at a time they land when queued together says."""
    link, reads_free = SharedLink(), LinkSpec(gbps=2.0, latency_us=500.0, per_read_us=0.0)
    transfers = [(f"d{i % 4}", f"r{i}", pull(reads_free, GEOMETRY, 16, 40 + 37 * i), [0.0]) for i in range(12)]
    together, one_by_one = dict(SharedLink().add(0.0, transfers)), {}
    for transfer in transfers:
        one_by_one.update(link.add(0.0, [transfer]))  # each time, those it moved
    assert one_by_one == pytest.approx(together, rel=1e-12)
    assert max(together.values()) == pytest.approx(sum(t.data_s for _, _, t, _ in transfers), rel=1e-12)
    for pair in range(4):
        landed = [together[f"r{i}"] for i in range(pair, 12, 4)]
        assert landed == sorted(landed)
