"""The simulator's front door (sim/front_door.py, sim/admission.py): admission's queue, rate limit and
expected-wait refusal in closed form on deterministic service, the predictor's padded lengths given
to the engines, and refused requests counted as failures."""

from __future__ import annotations

import math

import pytest

from kvmesh.policies.admission import AdmissionLimits
from kvmesh.sim.admission import AdmittedCluster
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.front_door import FrontDoor, PredictorSettings
from kvmesh.sim.metrics import slo_attainment, summarise
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology

STEP_S = 0.01  # every step, whatever its batch: one request alone is served in OUTPUT steps
OUTPUT = 10
SERVICE_S = OUTPUT * STEP_S


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
    """Four first tokens, at 0.01, 1.01, 2.01 and 3.01 s, then a burst at 5 s: the rate is 4 over the
    4.99 s since the first, so the k-th of the burst expects k x 4.99 / 4 s behind those ahead; with
    max_wait_s 5, k = 0..4 are let in and the other 15 refused."""
    cluster, _ = serve([0.0, 1.0, 2.0, 3.0] + [5.0] * 20, AdmissionLimits(max_wait_s=5.0))
    assert cluster.door.refused == {f"r{i}": "behind" for i in range(4 + 5, 24)}


def test_a_requests_ttft_slo_is_its_limit():
    cluster, requests = serve([0.0, 1.0, 2.0, 3.0] + [5.0] * 3, AdmissionLimits(max_wait_s=None,
                                                                                default_ttft_ms=2000.0))
    # k x 1.2475 s over 2 s from k = 2
    assert cluster.door.refused == {"r6": "behind"}
    assert all(r.ttft_slo_ms == 2000.0 for r in requests)


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
