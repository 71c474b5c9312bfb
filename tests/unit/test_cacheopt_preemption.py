"""CacheOpt preemption (3.4 victim order, 3.5 swap vs recompute): exact orders for a crafted set of
running requests and curves worked by hand (pure functions, no I/O)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.policies import preemption, registry
from kvmesh.policies.costs import RecomputeCurve, SwapCurve, SwapCurves, sweet_spot
from kvmesh.policies.swap_recompute import fit_curves, fit_recompute, fit_swap, sweet_spot_strategy
from kvmesh.policies.views import PoolView, RequestView, blocks_for

BLOCK = 8
LAYERS = 4


def request(request_id: str, arrival: float, *, computed: int, generated: int, max_tokens: int = 1000,
            tbt_slo_ms: float | None = None, predicted: int | None = None) -> RequestView:
    num_tokens = computed + 1   # decoding: the last sampled token's KV is not computed yet
    return RequestView(request_id=request_id, arrival=arrival, prompt_len=num_tokens - generated,
                       num_tokens=num_tokens, num_computed=computed, num_generated=generated,
                       max_tokens=max_tokens, blocks_per_layer=blocks_for(computed, BLOCK), tier="device",
                       tbt_slo_ms=tbt_slo_ms, predicted_output_len=predicted)


def pool(cxl_free: int = 10_000, curves: SwapCurves | None = None) -> PoolView:
    return PoolView(block_size=BLOCK, num_layers=LAYERS, free={"device": 0, "cxl": cxl_free},
                    total={"device": 1000, "cxl": 10_000}, swap_curves=curves)


# Buckets: TBT SLO edges 200/500 ms (no SLO: loosest), tokens by 128.
# id  arrival  SLO ms  bucket  remaining tokens              bucket  occupancy  bucket
# A   0        100     0       300 - 100 = 200               1       600        4
# B   1        1000    2       200 - 50 = 150                1       100        0
# C   2        none    2       max 500 - 20 = 480            3       300        2
# D   3        300     1       min(1000, max 400) - 0 = 400  3       50         0
# E   4        600     2       260 - 10 = 250                1       200        1
# F   5        250     1       outran 100: 0                 0       160        1
# G   6        700     2       250 - 10 = 240                1       130        1
RUNNING = [
    request("A", 0, computed=600, generated=100, tbt_slo_ms=100, predicted=300),
    request("B", 1, computed=100, generated=50, tbt_slo_ms=1000, predicted=200),
    request("C", 2, computed=300, generated=20, max_tokens=500),
    request("D", 3, computed=50, generated=0, max_tokens=400, tbt_slo_ms=300, predicted=1000),
    request("E", 4, computed=200, generated=10, tbt_slo_ms=600, predicted=260),
    request("F", 5, computed=160, generated=150, tbt_slo_ms=250, predicted=100),
    request("G", 6, computed=130, generated=10, tbt_slo_ms=700, predicted=250),
]


# -- victim order (3.4) ---------------------------------------------------------------------------

def test_remaining_time_is_the_capped_prediction_or_max_tokens():
    assert [r.predicted_remaining_tokens for r in RUNNING] == [200, 150, 480, 400, 250, 0, 240]


def test_tbt_slo_buckets_put_requests_without_an_slo_in_the_loosest():
    assert [preemption.tbt_slo_bucket(ms) for ms in (50, 199.9, 200, 499, 500, 2000, 10_000, None)] == \
        [0, 0, 1, 1, 2, 2, 2, 2]


def test_cacheopt_preempts_loose_slo_then_long_remaining_then_low_occupancy():
    # SLO bucket 2: C (remaining bucket 3), then B, G, E (remaining bucket 1) by occupancy bucket 0, 1, 1,
    # G before E on the tie (same buckets: the later arrival); bucket 1: D (remaining 3), F (0); bucket 0: A.
    assert preemption.cacheopt(RUNNING, pool()) == ["C", "B", "G", "E", "D", "F", "A"]


def test_fcfs_preempts_the_latest_arrival_first():
    assert preemption.latest_arrival_first(RUNNING, pool()) == ["G", "F", "E", "D", "C", "B", "A"]


def test_srtf_preempts_the_longest_remaining_time_first():
    assert preemption.srtf(RUNNING, pool()) == ["C", "D", "E", "G", "A", "B", "F"]


def test_lkvo_preempts_the_lowest_kv_occupancy_first():
    assert preemption.lkvo(RUNNING, pool()) == ["D", "B", "G", "F", "E", "C", "A"]


def test_orders_break_ties_by_latest_arrival():
    twins = [request("early", 1, computed=64, generated=8), request("late", 2, computed=64, generated=8)]
    for order in (preemption.cacheopt, preemption.srtf, preemption.lkvo, preemption.latest_arrival_first):
        assert order(twins, pool()) == ["late", "early"]


@pytest.mark.parametrize("hook, name, function", [
    ("preemption_order", "fcfs", preemption.latest_arrival_first),
    ("preemption_order", "srtf", preemption.srtf),
    ("preemption_order", "lkvo", preemption.lkvo),
    ("preemption_order", "cacheopt", preemption.cacheopt),
    ("preemption_strategy", "sweet_spot", sweet_spot_strategy),
])
def test_policies_are_registered_by_name(hook, name, function):
    assert registry.resolve(hook, name) is function


# -- fitting the curves (3.5) ---------------------------------------------------------------------

LENGTHS = np.geomspace(16, 8192, 12)


@pytest.mark.parametrize("truth", [RecomputeCurve(a=2e-8, b=1.7, k=3e-5, e=4e-3),
                                   RecomputeCurve(a=1e-6, b=2.0, k=1e-4, e=1e-2),
                                   RecomputeCurve(a=5e-11, b=2.6, k=2e-5, e=0.0)])
def test_recompute_fit_recovers_known_parameters(truth):
    fitted = fit_recompute(LENGTHS, truth(LENGTHS))
    for field in ("a", "b", "k", "e"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6, abs=1e-9)


def test_recompute_fit_follows_noisy_measurements():
    truth = RecomputeCurve(a=1e-6, b=2.0, k=1e-4, e=1e-2)
    noise = np.random.default_rng(7).normal(1.0, 0.01, LENGTHS.shape)
    fitted = fit_recompute(LENGTHS, truth(LENGTHS) * noise)
    assert np.allclose(fitted(LENGTHS), truth(LENGTHS), rtol=0.02)


def test_swap_fit_recovers_known_parameters():
    fitted = fit_swap(LENGTHS, SwapCurve(g=2e-5, d=1e-3)(LENGTHS))
    assert (fitted.g, fitted.d) == (pytest.approx(2e-5, rel=1e-9), pytest.approx(1e-3, rel=1e-9))


def test_fit_curves_takes_the_sweet_spot_of_the_fits():
    recompute, swap = RecomputeCurve(a=1e-6, b=2.0, k=0.0, e=0.0), SwapCurve(g=1e-3, d=0.0)
    curves = fit_curves(LENGTHS, recompute(LENGTHS), LENGTHS, swap(LENGTHS))
    assert curves.sweet_spot == pytest.approx(1000, rel=1e-6)


@pytest.mark.parametrize("lengths, seconds", [
    ([128, 256, 512], [0.1, 0.2, 0.4]),              # 3 points for 4 parameters
    ([128, 128, 256, 512], [0.1, 0.1, 0.2, 0.4]),    # 4 points, 3 lengths
    ([0, 128, 256, 512], [0.05, 0.1, 0.2, 0.4]),     # a zero length
    ([-64, 128, 256, 512], [0.1, 0.1, 0.2, 0.4]),    # a negative length
    ([64, 128, 256, 512], [0.1, 0.2, 0.4]),          # sizes differ
    ([64, 128, 256, 512], [0.1, math.nan, 0.2, 0.4]),
    ([64, 128, 256, 512], [0.0, 0.1, 0.2, 0.4]),     # a zero time
])
def test_recompute_fit_refuses_bad_points(lengths, seconds):
    with pytest.raises(ValueError):
        fit_recompute(lengths, seconds)


@pytest.mark.parametrize("lengths, seconds", [([128], [0.1]), ([128, 128], [0.1, 0.1]), ([0, 128], [0.05, 0.1]),
                                              ([64, 128], [-0.1, 0.1])])
def test_swap_fit_refuses_bad_points(lengths, seconds):
    with pytest.raises(ValueError):
        fit_swap(lengths, seconds)


# -- sweet spot and strategy (3.5) ----------------------------------------------------------------

def test_sweet_spot_where_quadratic_recompute_meets_linear_swap():
    # 1e-6 S^2 = 1e-3 S at S = 1000
    assert sweet_spot(RecomputeCurve(a=1e-6, b=2.0, k=0.0, e=0.0), SwapCurve(g=1e-3, d=0.0)) == \
        pytest.approx(1000, rel=1e-9)


def test_sweet_spot_by_the_quadratic_formula():
    # 1e-6 S^2 + 1e-4 S + 0.01 = 2e-3 S + 0.05  <=>  1e-6 S^2 - 1.9e-3 S - 0.04 = 0
    expected = (1.9e-3 + math.sqrt(1.9e-3**2 + 4 * 1e-6 * 0.04)) / (2 * 1e-6)   # ~1920.8
    assert sweet_spot(RecomputeCurve(a=1e-6, b=2.0, k=1e-4, e=0.01), SwapCurve(g=2e-3, d=0.05)) == \
        pytest.approx(expected, rel=1e-9)


def test_sweet_spot_when_one_strategy_always_wins():
    swap = SwapCurve(g=1e-3, d=0.0)
    assert sweet_spot(RecomputeCurve(a=1e-6, b=2.0, k=2e-3, e=0.0), swap) == 0.0      # recompute always slower
    assert sweet_spot(RecomputeCurve(a=0.0, b=2.0, k=1e-4, e=0.0), swap) is None      # recompute never slower


SWEET_1000 = SwapCurves.of(RecomputeCurve(a=1e-6, b=2.0, k=0.0, e=0.0), SwapCurve(g=1e-3, d=0.0))


def test_sweet_spot_strategy_recomputes_short_and_swaps_long_victims():
    short, long = request("s", 0, computed=999, generated=1), request("l", 0, computed=1001, generated=1)
    assert sweet_spot_strategy(short, pool(curves=SWEET_1000)) == "recompute"
    assert sweet_spot_strategy(long, pool(curves=SWEET_1000)) == "swap"


def test_sweet_spot_strategy_recomputes_when_cxl_is_full():
    long = request("l", 0, computed=2000, generated=1)   # 250 blocks a layer, 1000 in all
    assert sweet_spot_strategy(long, pool(cxl_free=999, curves=SWEET_1000)) == "recompute"
    assert sweet_spot_strategy(long, pool(cxl_free=1000, curves=SWEET_1000)) == "swap"


def test_sweet_spot_strategy_never_swaps_when_recompute_is_always_faster():
    never = SwapCurves.of(RecomputeCurve(a=0.0, b=2.0, k=1e-4, e=0.0), SwapCurve(g=1e-3, d=0.0))
    assert sweet_spot_strategy(request("l", 0, computed=100_000, generated=1), pool(curves=never)) == "recompute"


def test_sweet_spot_strategy_without_curves_swaps_as_the_swap_policy():
    short = request("s", 0, computed=16, generated=1)
    assert sweet_spot_strategy(short, pool()) == "swap"
    assert sweet_spot_strategy(short, pool(cxl_free=0)) == "recompute"
