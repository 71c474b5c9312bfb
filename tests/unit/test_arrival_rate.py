"""The predictor's arrival-rate estimate (policies/length/arrival_rate.py), the lambda of CacheOpt Eq. 4:
exponentially weighted, time as an argument, worked numbers."""

from __future__ import annotations

import math

import pytest

from kvmesh.policies.length.arrival_rate import ArrivalRate, arrive, rate_at


def arrivals(times: list[float], window_s: float) -> ArrivalRate:
    estimate = ArrivalRate()
    for now in times:
        estimate = arrive(estimate, now, window_s)
    return estimate


def test_one_arrival_adds_one_over_the_window():
    assert arrive(ArrivalRate(), 0.0, 10.0) == ArrivalRate(rate=0.1, at=0.0)


def test_arrivals_at_one_instant_add_up():
    assert rate_at(arrivals([5.0] * 10, 10.0), 5.0, 10.0) == pytest.approx(1.0, rel=1e-15)


def test_without_arrivals_the_rate_falls_by_e_each_window():
    estimate = arrive(ArrivalRate(), 0.0, 10.0)
    assert rate_at(estimate, 10.0, 10.0) == 0.1 * math.exp(-1)
    assert rate_at(estimate, 30.0, 10.0) == 0.1 * math.exp(-3)


def test_an_arrival_adds_to_the_decayed_rate():
    estimate = arrivals([0.0, 10.0], 10.0)
    assert estimate == ArrivalRate(rate=0.1 * math.exp(-1) + 0.1, at=10.0)


def test_a_steady_rate_reads_that_rate_on_average():
    # 2 req/s for 50 windows: just after an arrival the estimate is (1/w) / (1 - exp(-gap/w)), and
    # its average over the gap to the next arrival is lambda.
    window, gap = 1.0, 0.5
    estimate = arrivals([k * gap for k in range(100)], window)
    assert estimate.rate == pytest.approx((1 / window) / (1 - math.exp(-gap / window)), rel=1e-12)
    steps = 10_000
    over_gap = [rate_at(estimate, estimate.at + (i + 0.5) * gap / steps, window) for i in range(steps)]
    assert sum(over_gap) / steps == pytest.approx(2.0, rel=1e-6)


def test_a_clock_that_steps_back_counts_as_no_time():
    estimate = arrive(ArrivalRate(rate=1.0, at=10.0), 9.0, 10.0)
    assert estimate == ArrivalRate(rate=1.1, at=10.0)
    assert rate_at(estimate, 5.0, 10.0) == 1.1


@pytest.mark.parametrize("window", [0.0, -1.0, math.inf, math.nan])
def test_a_window_must_be_a_positive_finite_time(window):
    with pytest.raises(ValueError, match="rate window"):
        arrive(ArrivalRate(), 0.0, window)
