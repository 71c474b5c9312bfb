"""The simulated cluster: a request split across a prefill and a decode engine, the KV held until
the pull's COMPLETE, routing by the policies/routing functions, and no block left behind."""

import json

import pytest

from kvmesh.cli import main
from kvmesh.policies.routing import registry
from kvmesh.sim.cluster import Cluster, build
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.link import KVGeometry, LinkSpec, pull, push
from kvmesh.sim.metrics import summarise
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, poisson

COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)
SPEC = EngineSpec(block_size=16, device_blocks=256, token_budget=2048)
LINK = LinkSpec(gbps=2.0, latency_us=500.0, per_read_us=10.0)


def assert_no_leak(cluster: Cluster) -> None:
    for member in cluster.members.values():
        engine = member.engine
        assert engine.free == engine.spec.device_blocks
        assert not engine.held and not engine.pulling and not engine.running and not engine.waiting
    assert not cluster.handoffs


def test_one_request_through_1p1d_takes_its_prefill_the_transfer_and_its_decodes():
    """Prompt 100, 5 tokens: one prefill step makes the first; the pull of 7 blocks; the decode engine
    computes the last prompt token's KV (a one-token chunk of its prompt of 101) and samples, then 3
    decode steps, each reading its whole context."""
    cluster = build(Topology.parse("pd:1:1"), SPEC, COST, link=LINK)
    prefill, decode = cluster.members["engine-p0"].engine, cluster.members["engine-d0"].engine
    released = []
    hold = prefill.release_held
    prefill.release_held = lambda request_id: (released.append((request_id, prefill.free, dict(prefill.held))),
                                               hold(request_id))
    request = SimRequest("r0", 0.5, 100, 5)
    cluster.run([request])

    first = 0.5 + COST.seconds(100, 0, 0, 100 * 101 // 2)
    transfer = pull(LINK, KVGeometry(), 16, 100)
    t = first + transfer.data_s + transfer.latency_s
    expected = [first, t := t + COST.seconds(1, 0, 0, 101)]
    for position in (101, 102, 103):
        expected.append(t := t + COST.seconds(0, 1, position + 1, 0))
    assert request.token_times == pytest.approx(expected, rel=1e-12, abs=0)
    assert request.finished_at == request.token_times[-1]
    assert request.transfer_s == pytest.approx(transfer.seconds, rel=1e-9)
    # Held, counted as used, until the COMPLETE: 7 blocks, released once.
    assert [(r, free, list(held)) for r, free, held in released] == [("r0", SPEC.device_blocks - 7, ["r0"])]
    assert decode.free == prefill.free == SPEC.device_blocks
    summary = summarise([request], request.finished_at, 1.0)
    assert summary["ttft_p50_s"] == pytest.approx(first - 0.5, rel=1e-12)
    assert summary["transfer_share"] == pytest.approx(transfer.seconds / (request.finished_at - 0.5), rel=1e-9)
    assert_no_leak(cluster)


def test_coalescing_shortens_the_request_by_the_reads_it_saves():
    def latency(coalescing):
        cluster = build(Topology.parse("pd:1:1"), SPEC, COST,
                        link=LinkSpec(LINK.gbps, LINK.latency_us, LINK.per_read_us, coalescing=coalescing))
        request = SimRequest("r0", 0.0, 100, 3)
        cluster.run([request])
        assert_no_leak(cluster)
        return request.finished_at

    assert latency(False) - latency(True) == pytest.approx((7 - 1) * 4 * LINK.per_read_us * 1e-6, rel=1e-9)


def test_one_request_through_1p1d_in_push_mode_gets_its_first_token_after_the_last_write():
    """The decode engine reserves first (at once, here); the prefill step's 4 layers are written as they
    are computed, so the last layer's write and the ACK follow the step; then the decode steps."""
    cluster = build(Topology.parse("pd:1:1"), SPEC, COST, link=LINK, transfer_mode="push")
    request = SimRequest("r0", 0.5, 100, 3)
    cluster.run([request])

    step = COST.seconds(100, 0, 0, 100 * 101 // 2)
    transfer = push(LINK, KVGeometry(), 16, 0, 100)
    first = 0.5 + step + transfer.data_s / KVGeometry().num_layers + transfer.latency_s
    second = first + COST.seconds(1, 0, 0, 101)
    assert request.token_times == pytest.approx([first, second, second + COST.seconds(0, 1, 102, 0)],
                                                rel=1e-12, abs=0)
    assert request.transfer_s == pytest.approx(first - 0.5 - step, rel=1e-9)
    assert_no_leak(cluster)


def test_push_waits_for_decode_memory_before_the_prefill_and_pull_does_not():
    """The decode engine has room for one request's KV (7 of its 10 blocks, 9 at the end): in push mode the
    second one's prefill starts only when the first has finished and freed them; in pull mode it
    prefills right after the first, and its decode part waits there for blocks."""
    def first_tokens(mode):
        cluster = Cluster({"engine-p0": ("prefill", SimEngine(SPEC, COST)),
                           "engine-d0": ("decode", SimEngine(EngineSpec(block_size=16, device_blocks=10), COST))},
                          link=LINK, transfer_mode=mode)
        requests = [SimRequest("a", 0.0, 100, 40), SimRequest("b", 0.0, 100, 5)]
        cluster.run(requests)
        assert_no_leak(cluster)
        return [r.token_times[0] for r in requests], requests[0].finished_at

    (a, b), a_done = first_tokens("push")
    assert b > a_done > a
    (a, b), a_done = first_tokens("pull")
    assert a < b < a_done


def recorded(function, calls):
    def call(*args):
        calls.append((args, result := function(*args)))
        return result
    return call


def decode_engines(cluster):
    """Which decode engine each request's decode part went to, in order."""
    seen = []
    for engine_id, member in cluster.members.items():
        if member.role == "decode":
            add = member.engine.add
            member.engine.add = lambda r, add=add, engine_id=engine_id: (seen.append((r.request_id, engine_id)),
                                                                         add(r))[1]
    return seen


def test_round_robin_sends_decodes_to_the_two_engines_in_turn():
    cluster = build(Topology.parse("pd:1:2"), SPEC, COST, routing="round_robin", link=LINK)
    calls = []
    cluster.route = recorded(cluster.route, calls)
    seen = decode_engines(cluster)
    cluster.run([SimRequest(f"r{i}", i * 1.0, 64, 4) for i in range(4)])
    assert seen == [("r0", "engine-d0"), ("r1", "engine-d1"), ("r2", "engine-d0"), ("r3", "engine-d1")]
    assert [answer.decode for _, (answer, _) in calls] == [engine for _, engine in seen]
    (query, views, _), _ = calls[0]
    assert query.prompt_tokens == 64 and sorted((v.id, v.role) for v in views) == \
        [("engine-d0", "decode"), ("engine-d1", "decode"), ("engine-p0", "prefill")]
    assert_no_leak(cluster)


def test_least_loaded_sends_a_request_to_the_emptier_decode_engine():
    """r1 arrives while r0 prefills: no heartbeat since r0 was routed to d0, so r0 counts there as
    waiting, its blocks taken, and the policy picks d1. r2 comes when both are empty again, after
    heartbeats: the first by id."""
    cluster = build(Topology.parse("pd:1:2"), SPEC, COST, routing="least_loaded", link=LINK)
    calls = []
    cluster.route = recorded(cluster.route, calls)
    seen = decode_engines(cluster)
    cluster.run([SimRequest("r0", 0.0, 500, 4), SimRequest("r1", 1e-3, 64, 4), SimRequest("r2", 5.0, 64, 4)])
    assert sorted(seen) == [("r0", "engine-d0"), ("r1", "engine-d1"), ("r2", "engine-d0")]
    views = {v.id: v.load for v in calls[1][0][1]}
    assert views["engine-d0"].waiting == 1 and views["engine-d0"].free_device_blocks == SPEC.device_blocks - 32
    assert views["engine-d1"].waiting == 0 and views["engine-d1"].free_device_blocks == SPEC.device_blocks
    assert_no_leak(cluster)


@pytest.mark.parametrize("heartbeat_s, colocated", [(0.0, True), (1.0, False)])
def test_conditional_prefills_on_an_idle_decode_engine_while_the_prefill_engine_is_backed_up(heartbeat_s, colocated):
    """Four prompts at once on 1P1D: r0 runs, r1 and r2 wait on p0. With loads seen as they are, d0
    has nobody waiting and r3 prefills there, colocated; within one heartbeat the three routed to d0
    since count as waiting there, and r3 goes to the pair like the others."""
    cluster = build(Topology.parse("pd:1:1"), SPEC, COST, link=LINK, heartbeat_s=heartbeat_s)
    calls = []
    cluster.route = recorded(cluster.route, calls)
    requests = [SimRequest(f"r{i}", 0.0, 300, 4) for i in range(4)]
    cluster.run(requests)
    assert [answer.mode for _, (answer, _) in calls] == ["disaggregated"] * 3 + \
        ["colocated" if colocated else "disaggregated"]
    assert (requests[3].transfer_s is None) == colocated and all(r.num_generated == 4 for r in requests)
    assert_no_leak(cluster)


@pytest.mark.parametrize("topology, routing, mode", [
    ("pd:1:1", "conditional", "pull"), ("pd:2:2", "least_loaded", "pull"), ("pd:2:1", "round_robin", "pull"),
    ("pd:2:2", "conditional", "push"), ("colocated:2", "least_loaded", "pull")])
def test_a_workload_finishes_whole_with_nothing_held(topology, routing, mode):
    requests = poisson(40.0, 300, Lengths.parse("uniform:16-400"), Lengths.parse("exp:24"), seed=3)
    cluster = build(Topology.parse(topology), EngineSpec(block_size=16, device_blocks=160, max_num_seqs=16), COST,
                    routing=routing, link=LINK, transfer_mode=mode)
    cluster.run(requests)
    assert all(r.finished_at is not None and r.num_generated == r.max_tokens for r in requests)
    assert all(r.token_times == sorted(r.token_times) and r.token_times[0] > r.arrival for r in requests)
    handed = [r for r in requests if r.transfer_s is not None]
    assert (len(handed) > 0) == topology.startswith("pd")
    assert all(r.transfer_s >= LINK.latency_us * 1e-6 for r in handed)
    assert_no_leak(cluster)


class Ends(Cluster):
    """A cluster that notes each request's end through the public hook."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.noted: list[tuple[str, str, float]] = []

    def ended(self, request: SimRequest, engine_id: str) -> None:
        self.noted.append((request.request_id, engine_id, request.finished_at))


@pytest.mark.parametrize("topology, mode, max_run_steps", [
    ("colocated:2", "pull", 0), ("colocated:2", "pull", 4096), ("pd:1:2", "pull", 4096), ("pd:1:2", "push", 0)])
def test_a_subclass_hears_of_each_request_given_to_run_once_as_it_ends(topology, mode, max_run_steps):
    requests = poisson(40.0, 200, Lengths.parse("uniform:16-400"), Lengths.parse("exp:24"), seed=3)
    engines = {engine_id: (role, SimEngine(SPEC, COST)) for engine_id, role in Topology.parse(topology).roles().items()}
    cluster = Ends(engines, link=LINK, transfer_mode=mode, max_run_steps=max_run_steps)
    cluster.run(requests)
    by_id = {r.request_id: r for r in requests}
    assert sorted(request_id for request_id, _, _ in cluster.noted) == sorted(by_id)
    for request_id, engine_id, finished_at in cluster.noted:
        request = by_id[request_id]
        assert finished_at == request.finished_at is not None and request.num_generated == request.max_tokens
        if request.max_tokens > 1:  # served whole on its engine, or split: its decode engine's
            assert cluster.members[engine_id].role == ("decode" if topology.startswith("pd") else "both")


def test_a_decode_engine_that_can_never_hold_the_request_lets_the_held_kv_go():
    small = EngineSpec(block_size=16, device_blocks=8)
    prefill, decode = SimEngine(SPEC, COST), SimEngine(small, COST)
    cluster = Cluster({"engine-p0": ("prefill", prefill), "engine-d0": ("decode", decode)}, link=LINK)
    request = SimRequest("r0", 0.0, 100, 40)  # 140 tokens: 9 blocks, more than the decode engine has
    cluster.run([request])
    assert request.finished_at is None and len(request.token_times) == 1 and decode.refused
    assert prefill.free == SPEC.device_blocks and not prefill.held


def test_topologies_parse_and_bad_ones_are_refused():
    assert Topology.parse("colocated:2").roles() == {"engine-c0": "both", "engine-c1": "both"}
    assert Topology.parse("pd:1:2").roles() == {"engine-p0": "prefill", "engine-d0": "decode", "engine-d1": "decode"}
    for text in ("pd:1", "pd:0:1", "colocated:0", "mesh:2", "pd:a:b"):
        with pytest.raises(ValueError):
            Topology.parse(text)
    assert registry.DEFAULT == build(Topology.parse("colocated:1"), SPEC, COST).routing


def test_sim_run_takes_a_topology_and_a_link(tmp_path, capsys):
    out = tmp_path / "pd.json"
    assert main(["sim", "run", "--topology", "pd:1:1", "--routing", "round_robin", "--requests", "100",
                 "--rate", "5", "--link-gbps", "1.5", "--link-latency-us", "800", "--no-coalescing",
                 "--kv-geometry", "8:4:64:2", "--json", str(out)]) == 0
    assert "KV transfer mean (share)" in capsys.readouterr().out
    body = json.loads(out.read_text())
    assert body["config"]["topology"] == "pd:1:1" and body["config"]["routing"] == "round_robin"
    assert body["config"]["link"]["gbps"] == 1.5 and body["config"]["link"]["coalescing"] is False
    assert body["config"]["kv_geometry"]["num_layers"] == 8
    assert body["results"]["unfinished"] == 0 and 0 < body["results"]["transfer_share"] < 1
    assert main(["sim", "run", "--topology", "pd:2:1", "--transfer-mode", "push", "--requests", "50",
                 "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert body["config"]["transfer_mode"] == "push" and body["results"]["unfinished"] == 0
    capsys.readouterr()
    assert main(["sim", "run", "--topology", "pd:1", "--requests", "5"]) == 2
    assert "topology" in capsys.readouterr().err
