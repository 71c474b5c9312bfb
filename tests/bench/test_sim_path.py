"""The request's path outside the engines (sim/request_path.py) with its growth with the load: the
requests in flight at each one's first token counted the same on both sides, the lag's line fitted
to them exactly, and the simulated tokens delivered through it."""

from __future__ import annotations

import pytest

from kvmesh.sim.request import SimRequest
from kvmesh.sim.request_path import RequestPath, delivered, measure, requests_in_flight


def test_the_requests_in_flight_at_each_first_token():
    # r0 [0, 10), first token 1; r1 [2, 5), first 3; r2 [4, 12), first 6; r3 [11, 13), first 12
    assert requests_in_flight([0, 2, 4, 11], [1, 3, 6, 12], [10, 5, 12, 13]) == [0, 1, 1, 0]


def test_the_lag_is_fitted_as_a_line_through_the_requests_in_flight():
    in_flight = [0, 1, 2, 4, 4]
    lags = [0.003 + 0.0005 * n for n in in_flight]
    ttft = [0.05] * 5
    path = measure(ttft, [t + 1.0 + lag for t, lag in zip(ttft, lags)], [0.04] * 5, [1.0] * 5, in_flight)
    assert path.first_token_s == pytest.approx(0.01)
    assert path.last_token_lag_s == pytest.approx(0.003)
    assert path.last_token_lag_per_request_s == pytest.approx(0.0005)
    # Without the counts, or with a lag that shrinks with them, it is the mean.
    assert measure(ttft, [t + 1.0 + lag for t, lag in zip(ttft, lags)], [0.04] * 5, [1.0] * 5).last_token_lag_s == \
        pytest.approx(0.003 + 0.0005 * 2.2)
    shrinking = measure(ttft, [t + 1.0 + 0.01 - lag for t, lag in zip(ttft, lags)], [0.04] * 5, [1.0] * 5, in_flight)
    assert shrinking.last_token_lag_per_request_s == 0.0


def test_a_simulated_request_is_delivered_later_with_each_request_in_flight():
    alone = SimRequest("a", 0.0, 8, 2, token_times=[0.1, 0.2], finished_at=0.2)
    crowded = [SimRequest(f"r{i}", 1.0, 8, 2, token_times=[1.1, 1.3], finished_at=1.3) for i in range(3)]
    delivered([alone, *crowded], RequestPath(first_token_s=0.01, last_token_lag_s=0.002,
                                             last_token_lag_per_request_s=0.001))
    assert alone.token_times == pytest.approx([0.11, 0.212]) and alone.finished_at == pytest.approx(0.212)
    assert crowded[0].token_times == pytest.approx([1.11, 1.3 + 0.012 + 0.002])  # two others in flight
