"""`kvmesh plan` with admission's front door as a search dimension: a refused request (or turn) is a
failure, so the door raises goodput only where refusing the excess lets the rest meet the SLOs; a
refused turn ends its conversation."""

import json

import pytest

from kvmesh.cli import main
from kvmesh.policies.admission import AdmissionLimits
from kvmesh.sim.admission import AdmittedCluster
from kvmesh.sim.conversations import Conversations, conversation_turns
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.front_door import FrontDoor
from kvmesh.sim.plan_search import Candidate, Simulator, bisect_goodput, door_limits, front_door_choices
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths

STEP_S, OUTPUT = 0.01, 10  # one request at a time (max_num_seqs 1), OUTPUT steps each
CAPACITY = 1 / (OUTPUT * STEP_S)  # 10 req/s


def goodputs(target: float) -> dict[bool, float]:
    """Without and with the door: one engine serving one request at a time, TTFT SLO 5 services."""
    simulator = Simulator(Lengths("fixed", 32), Lengths("fixed", OUTPUT), 2000, 0, {"ttft": 0.5},
                          EngineSpec(max_num_seqs=1), StepCost(a=STEP_S))
    found = {}
    for door in (False, True):
        candidate = Candidate(Topology(colocated=1), "round_robin", "latest_arrival_first", front_door=door)
        found[door] = bisect_goodput(lambda rate: simulator.run(candidate, rate).attainment["all"], target,
                                     CAPACITY, 0.02).rate
    return found


def test_refusing_the_excess_raises_goodput_up_to_capacity_over_the_target():
    """Past capacity an open queue grows for the whole run and every later request misses its TTFT: the
    goodput stays below capacity. A door refusing the excess serves at most capacity, so at rate R at
    most capacity / R meet the SLO: the goodput is at most capacity / target, and here above capacity
    (1.23x: the backlog's wait counts the requests without a first token, not the rest of the one
    being answered, which an engine serving one at a time makes a new request wait for as well)."""
    found = goodputs(0.5)
    assert found[False] < CAPACITY < found[True] <= CAPACITY / 0.5


def test_at_full_attainment_the_door_cannot_raise_goodput():
    """Every request must meet the SLOs: a run in which the door refused one misses, and one in which it
    refused none ran as without it, so the door's goodput is at most the open queue's; at the highest
    rate where every request meets it, the door refuses nobody (the backlog's wait is per busy second,
    so a request arriving behind one other is not refused for the gap between arrivals)."""
    found = goodputs(1.0)
    assert found[True] == found[False]


def test_the_door_is_searched_only_with_an_slo_a_wait_can_break():
    assert front_door_choices(["off", "on"], {"ttft": 0.2, "tpot": 0.02}) == [False, True]
    assert front_door_choices(["off", "on"], {"e2e": 2.0}) == [False, True]
    assert front_door_choices(["off", "on"], {"tpot": 0.02}) == [False]
    with pytest.raises(ValueError, match="front door 'maybe'"):
        front_door_choices(["maybe"], {"ttft": 0.2})
    assert door_limits({"ttft": 0.2}, 3, EngineSpec(max_num_seqs=8)) == AdmissionLimits(max_running=24,
                                                                                         max_wait_s=None)
    assert door_limits({"e2e": 2.0}, 1, EngineSpec()).max_wait_s == 2.0


def test_a_refused_turn_ends_its_conversation():
    """Two conversations start at once into one slot and no queue: the second's first turn is refused,
    its later turns never sent; the first's turns each come a think time after the answer before."""
    shape = Conversations(rate=1e6, turns=3, history=0, message=Lengths("fixed", 32), output=Lengths("fixed", 4),
                          think_s=1.0, max_context=4096)
    talks = conversation_turns(shape, 6, 16, seed=0)
    turns = [request for talk in talks for request, _ in talk]
    door = FrontDoor(AdmissionLimits(max_running=1, max_queued=0, max_wait_s=None))
    cluster = AdmittedCluster.build(Topology(colocated=1), EngineSpec(), StepCost(a=STEP_S), None, door, talks)
    cluster.run(turns)
    assert door.refused == {"c1t0": "queue_full"}
    assert [r.finished_at is not None for r in turns] == [True, True, True, False, False, False]
    first = talks[0]
    for (before, think), (after, _) in zip(first, first[1:]):
        assert after.arrival == before.finished_at + think


def test_plan_searches_the_front_door_and_counts_its_refusals(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--rate", "20", "--requests", "200", "--prompt", "uniform:64-256", "--output", "exp:32",
                 "--slo", "ttft=200", "--engines", "1", "--routing", "round_robin", "--kv-allocations",
                 "block_at_a_time", "--preemption-orders", "latest_arrival_first", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert body["config"]["search"]["front_door"] == [False, True]
    assert [r["configuration"] for r in sorted(body["results"], key=lambda r: r["front_door"])] == [
        "colocated:1 round_robin block_at_a_time latest_arrival_first recompute",
        "colocated:1 round_robin front_door block_at_a_time latest_arrival_first recompute"]
    for r in body["results"]:
        assert all((p["refused"] is None) == (not r["front_door"]) for p in r["probes"])
        assert all(p["unfinished"] >= (p["refused"] or 0) for p in r["probes"])  # a refused one is unfinished
    assert "refused at the front door" in capsys.readouterr().out


def test_plan_runs_conversations_behind_the_front_door(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--rate", "2", "--requests", "120", "--prompt", "uniform:32-96", "--output", "exp:32",
                 "--turns", "4", "--system-prompt", "256", "--think-s", "0.5", "--slo", "ttft=50", "--engines", "1",
                 "--routing", "round_robin", "--caches", "lru", "--front-doors", "on", "--kv-allocations",
                 "block_at_a_time", "--preemption-orders", "latest_arrival_first", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["front_door"] and result["cache"] == "lru"
    assert any(p["refused"] for p in result["probes"]) and result["goodput_rps"] > 0


def test_sim_run_serves_conversations_behind_the_front_door(tmp_path):
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--rate", "4", "--requests", "120", "--turns", "4", "--think-s", "0.5",
                 "--prompt", "uniform:32-96", "--output", "exp:32", "--max-running", "2", "--max-queued", "0",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    door = results["admission"]
    # a refused turn is unfinished, and so is every turn of its conversation after it, never sent
    assert door["refused"] == door["refused_by"]["queue_full"] > 0
    assert results["unfinished"] > door["refused"] and door["let_in"] == results["requests"] - results["unfinished"]
