"""The simulator's front door (sim/front_door.py, sim/admission.py): admission's queue, rate limit and
expected-wait refusal in closed form on deterministic service, the predictor's padded lengths given
to the engines, and refused requests counted as failures."""

from __future__ import annotations

import json
import math

import pytest

from kvmesh.cli import main
from kvmesh.policies.admission import AdmissionLimits
from kvmesh.sim.admission import AdmittedCluster
from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.front_door import FrontDoor, PredictorSettings
from kvmesh.sim.metrics import slo_attainment, summarise
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, poisson

STEP_S = 0.01  # every step, whatever its batch: one request alone is served in OUTPUT steps
OUTPUT = 10
SERVICE_S = OUTPUT * STEP_S
COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)


def serve(arrivals: list[float], limits: AdmissionLimits, predictor: PredictorSettings | None = None,
          topology: str = "colocated:1", outputs: list[int] | None = None) -> tuple[AdmittedCluster, list[SimRequest]]:
    requests = [SimRequest(f"r{i}", t, 32, OUTPUT if outputs is None else outputs[i]) for i, t in enumerate(arrivals)]
    cluster = AdmittedCluster.build(Topology.parse(topology), EngineSpec(), StepCost(a=STEP_S), None,
                                    FrontDoor(limits, predictor))
    cluster.run(requests)
    return cluster, requests


def test_a_burst_fills_the_slots_and_the_queue_and_the_rest_is_refused():
    """D/D/1/K: N at once, one slot, K places: 1 + K served back to back, each S after the one before."""
    n, k = 12, 4
    cluster, requests = serve([0.0] * n, AdmissionLimits(max_running=1, max_queued=k, max_wait_s=None))
    assert cluster.door.refused == {f"r{i}": "queue_full" for i in range(1 + k, n)}
    served = requests[:1 + k]
    assert [r.finished_at for r in served] == pytest.approx([(i + 1) * SERVICE_S for i in range(1 + k)])
    assert [r.token_times[0] - r.arrival for r in served] == pytest.approx([i * SERVICE_S + STEP_S
                                                                           for i in range(1 + k)])
    assert sorted(cluster.queue_waits()) == pytest.approx([i * SERVICE_S for i in range(1 + k)])


def test_periodic_arrivals_faster_than_service_are_refused_as_d_d_1_k_says():
    """Arrivals every g < S fill one slot and K places before the first departure (K g < S); from then
    on each departure's place goes to the next arrival. Of N arrivals, the last at (N - 1) g, the
    refused are N - 1 - K - floor((N - 1) g / S)."""
    n, k, gap = 50, 3, 0.0237
    cluster, requests = serve([j * gap for j in range(n)], AdmissionLimits(max_running=1, max_queued=k,
                                                                           max_wait_s=None))
    assert len(cluster.door.refused) == n - 1 - k - math.floor((n - 1) * gap / SERVICE_S) == 35
    summary = summarise(requests, 0.0, 1.0)
    assert summary["unfinished"] == 35  # every request counts: the refused are failures
    assert slo_attainment(requests, {"e2e": 10.0})["e2e"] == pytest.approx(15 / 50)


def test_the_rate_limit_lets_in_the_burst_then_the_rate():
    """A token bucket of 3 at once, 2 a second; arrivals 4 a second for 9.75 s: 3 + floor(2 x 9.75)."""
    cluster, requests = serve([j * 0.25 for j in range(40)], AdmissionLimits(requests_per_s=2.0, burst=3.0))
    assert len(cluster.door.refused) == 40 - 22
    assert set(cluster.door.refused.values()) == {"rate_limit"}
    assert all(r.finished_at is not None for r in requests if r.request_id not in cluster.door.refused)


def test_a_request_that_would_wait_past_max_wait_behind_the_backlog_is_refused():
    """Four requests, at 0, 1, 2 and 3 s, each given its first token one step (0.01 s) later, then a
    burst at 5 s: the cluster gave 4 first tokens in 0.04 busy seconds, so the k-th of the burst
    expects k x 0.01 s behind those ahead; with max_wait_s 0.055, k = 0..5 are let in and the other 14
    refused."""
    cluster, _ = serve([0.0, 1.0, 2.0, 3.0] + [5.0] * 20, AdmissionLimits(max_wait_s=0.055))
    assert cluster.door.refused == {f"r{i}": "behind" for i in range(4 + 6, 24)}


def test_a_requests_ttft_slo_is_its_limit():
    cluster, requests = serve([0.0, 1.0, 2.0, 3.0] + [5.0] * 3, AdmissionLimits(max_wait_s=None,
                                                                                default_ttft_ms=15.0))
    # k x 0.01 s over 0.015 s from k = 2
    assert cluster.door.refused == {"r6": "behind"}
    assert all(r.ttft_slo_ms == 15.0 for r in requests)


def test_the_engines_get_the_predictors_padded_lengths():
    """The oracle predicts each length exactly, unpadded: the engines are told it, its range a point."""
    outputs = [5, 9, 13]
    cluster, requests = serve([0.0, 0.1, 0.2], AdmissionLimits(), PredictorSettings("oracle", max_tokens=64),
                              outputs=outputs)
    told = [(r.predicted_output_len, r.predicted_output_low, r.predicted_output_median) for r in requests]
    assert told == [(n, n, n) for n in outputs]
    assert [r.num_generated for r in requests] == outputs


def test_the_history_predictor_learns_the_lengths_that_ended():
    """history: a key with no history gets max_tokens, unpadded; after lengths of 10 ended it predicts
    10, padded by Eq. 3 over a range of 0 (no padding)."""
    cluster, requests = serve([0.0, 5.0], AdmissionLimits(), PredictorSettings("history", max_tokens=64))
    assert [r.predicted_output_len for r in requests] == [64, 10]


def test_requests_split_across_a_pair_free_their_slot_when_their_decode_ends():
    cluster, requests = serve([0.0] * 4, AdmissionLimits(max_running=1, max_queued=8, max_wait_s=None),
                              topology="pd:1:1")
    assert not cluster.door.refused and all(r.finished_at for r in requests)
    # one at a time: each starts, and so gets its first token, after the one before it ended
    assert all(after.token_times[0] > before.finished_at for before, after in zip(requests, requests[1:]))
    assert all(r.transfer_s is not None for r in requests)


def test_a_front_door_that_refuses_and_queues_nothing_changes_nothing():
    workload = dict(rate=30.0, n=200, prompt=Lengths.parse("uniform:64-512"), output=Lengths.parse("exp:64"), seed=1)
    plain, admitted = poisson(**workload), poisson(**workload)
    build(Topology.parse("pd:1:2"), EngineSpec(device_blocks=512), COST).run(plain)
    open_door = AdmissionLimits(max_running=10_000, max_wait_s=None)
    AdmittedCluster.build(Topology.parse("pd:1:2"), EngineSpec(device_blocks=512), COST, None,
                          FrontDoor(open_door)).run(admitted)
    assert [(r.token_times, r.finished_at, r.preemptions, r.transfer_s) for r in admitted] == \
        [(r.token_times, r.finished_at, r.preemptions, r.transfer_s) for r in plain]


def test_sim_run_turns_the_front_door_on_by_admissions_config_names(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--rate", "30", "--requests", "300", "--max-running", "8", "--max-queued", "5",
                 "--rate-limit", "40", "--max-wait-s", "none", "--default-ttft-ms", "500", "--predictor", "history",
                 "--json", str(out)]) == 0
    assert "admission: refused" in capsys.readouterr().out
    body = json.loads(out.read_text())
    assert body["config"]["admission"] == {
        "requests_per_s": 40.0, "burst": 40.0, "max_running": 8, "max_queued": 5, "max_wait_s": None,
        "default_ttft_ms": 500.0, "default_tbt_ms": None, "predictor": "history", "rate_window_s": 10.0}
    results = body["results"]
    door = results["admission"]
    assert set(door) == {"let_in", "refused", "refused_by", "queued", "queue_wait_mean_s", "queue_wait_p90_s"}
    assert door["let_in"] + door["refused"] == results["requests"] == 300
    assert door["refused"] == sum(door["refused_by"].values()) > 0 and results["unfinished"] == door["refused"]
    assert 0 < door["queued"] <= door["let_in"] and door["queue_wait_p90_s"] > 0


def test_sim_run_without_admission_flags_has_no_front_door(tmp_path):
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--rate", "30", "--requests", "50", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert body["config"]["admission"] is None and body["results"]["admission"] is None


@pytest.mark.parametrize("argv, message", [
    (["--predictor", "embedding"], "prompt's text"),
    (["--predictor", "nobody"], "nobody"),
])
def test_sim_run_refuses_a_predictor_it_cannot_run(capsys, argv, message):
    assert main(["sim", "run", "--requests", "5", *argv]) == 2
    assert message in capsys.readouterr().err
