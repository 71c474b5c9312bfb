"""`kvmesh bench peer`'s rule, on made-up figures (no servers): capacity, the credited capacities and the
latency ratios its keys are read from, failed requests at the top of the distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.bench.peer import TARGETS, capacity, compare, cores_per_rank, figures, prompts_at, turns
from kvmesh.bench.report import judge, percentile

RATES = (0.5, 1.0, 1.5, 2.0, 3.0)


def point(e2e_p90: float, ttft_p90: float = 500.0, failed: int = 0) -> dict[str, float]:
    return {"e2e p90": e2e_p90, "ttft p90": ttft_p90, "failed": float(failed)}


def sweep(e2e: list[float], ttft: list[float] | None = None, failed: list[int] | None = None) -> dict:
    ttft = ttft or [500.0] * len(RATES)
    failed = failed or [0] * len(RATES)
    return {rate: point(e, t, f) for rate, e, t, f in zip(RATES, e2e, ttft, failed)}


def cells_of(**setups: dict) -> dict:
    return {(name, rate): cells for name, by_rate in setups.items() for rate, cells in by_rate.items()}


def test_prompts_per_rate_follow_the_plan():
    assert [prompts_at(r, quick=False) for r in RATES] == [24, 30, 45, 60, 60]
    assert {prompts_at(r, quick=True) for r in (1.0, 2.0)} == {12}


def test_capacity_is_the_last_rate_of_the_unbroken_run_under_the_slo():
    assert capacity(sweep([1] * 5)) == 3.0
    assert capacity(sweep([1] * 5, ttft=[100, 900, 2500, 800, 3000])) == 1.0  # 2.0 passing again does not count
    assert capacity(sweep([1] * 5, failed=[0, 0, 0, 1, 0])) == 1.5           # one failed request is a miss
    assert capacity(sweep([1] * 5, ttft=[2000, 1, 1, 1, 1])) is None          # 2 s itself is not under 2 s


def test_keys_compare_the_faster_vllm_with_the_fastest_kvmesh_at_each_rate():
    cells = cells_of(
        vllm=sweep([1000, 1200, 2000, 4000, 9000], ttft=[300, 400, 900, 2500, 6000]),
        vllm_gguf=sweep([1100, 1100, 2400, 5000, 9500], ttft=[300, 400, 2100, 3000, 7000]),
        kvmesh_colocated=sweep([800, 1000, 1600, 3000, 8000], ttft=[200, 300, 500, 900, 2100]),
        kvmesh_1p1d=sweep([900, 900, 1700, 2500, 7000], ttft=[200, 300, 600, 1800, 2500]))
    ratios, read = compare(cells, RATES)
    assert read["vllm_at_rate"] == {"0.5": "vllm", "1": "vllm_gguf", "1.5": "vllm", "2": "vllm", "3": "vllm"}
    assert read["kvmesh_at_rate"]["1"] == "kvmesh_1p1d" and read["kvmesh_at_rate"]["0.5"] == "kvmesh_colocated"
    assert ratios["p90_e2el_ratio_vllm_vs_kvmesh@1"] == pytest.approx(1100 / 900)
    assert ratios["p90_e2el_ratio_vllm_vs_kvmesh@2"] == pytest.approx(4000 / 2500)
    assert ratios["p90_e2el_ratio_vllm_vs_kvmesh_colocated@2"] == pytest.approx(4000 / 3000)
    assert ratios["p90_e2el_ratio_vllm_vs_kvmesh_1p1d@0.5"] == pytest.approx(1000 / 900)
    # vLLM holds to 1.5 (vllm; gguf only to 1.0), kvmesh to 2.0 (both): 2.0 / 1.5
    assert read["capacity_rps"] == {"vllm": 1.5, "vllm_gguf": 1.0, "kvmesh_colocated": 2.0, "kvmesh_1p1d": 2.0}
    assert ratios["capacity_ratio_kvmesh_vs_vllm"] == pytest.approx(2.0 / 1.5)
    # the minimum over 0.5, 1 and 1.5 req/s: 1000/800, 1100/900, 2000/1600
    assert read["min_to_capacity_rates"] == [0.5, 1.0, 1.5]
    assert ratios["p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity"] == pytest.approx(1100 / 900)
    assert judge(ratios, TARGETS, {}) == {"p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity": True,
                             "capacity_ratio_kvmesh_vs_vllm": True}
    assert not read["capacity_ratio_is_lower_bound"]


def test_capacity_below_the_lowest_rate_is_credited_the_lowest_to_vllm_and_zero_to_kvmesh():
    slow = sweep([5000] * 5, ttft=[2500] * 5)
    ratios, read = compare(cells_of(vllm=slow, kvmesh_colocated=sweep([1000] * 5)), RATES)
    assert read["capacity_rps"]["vllm"] is None and read["capacity_credited_rps"]["vllm"] == 0.5
    assert ratios["capacity_ratio_kvmesh_vs_vllm"] == pytest.approx(3.0 / 0.5)
    assert read["capacity_ratio_is_lower_bound"]                       # kvmesh held at every swept rate
    assert read["min_to_capacity_rates"] == [0.5]
    ratios, read = compare(cells_of(vllm=sweep([1000] * 5), kvmesh_colocated=slow), RATES)
    assert ratios["capacity_ratio_kvmesh_vs_vllm"] == 0.0
    assert judge(ratios, TARGETS, {})["capacity_ratio_kvmesh_vs_vllm"] is False


def test_failed_requests_sit_at_the_top_and_two_infinities_compare_to_nothing():
    inf = math.inf
    ratios, _ = compare(cells_of(vllm=sweep([inf, inf, 1, 1, 1]), kvmesh_colocated=sweep([inf, 2, 1, 1, 1])), RATES)
    assert math.isnan(ratios["p90_e2el_ratio_vllm_vs_kvmesh@0.5"])
    assert ratios["p90_e2el_ratio_vllm_vs_kvmesh@1"] == inf
    assert not judge({**ratios, "p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity": math.nan}, TARGETS, {})[
        "p90_e2el_ratio_vllm_vs_kvmesh_min_to_capacity"]
    assert set(TARGETS) <= set(ratios)


def test_percentile_matches_numpy_and_puts_failures_on_top():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (50, 90):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([*values, math.inf], 50) == pytest.approx(np.percentile([*values, 1e9], 50))
    assert percentile([1.0] * 9 + [math.inf], 90) == math.inf   # interpolated towards a failure


def test_figures_count_every_request_and_read_vllms_detailed_result():
    result = {"output_lens": [64, 64, 0], "ttfts": [0.1, 0.3, 0.0], "latencies": [1.1, 2.3, 0.0],
              "request_throughput": 0.5, "p50_itl_ms": 16.0, "p90_itl_ms": 30.0}
    cells = figures(result, prompts=4)   # one failed in the result, one the result never listed
    assert (cells["completed"], cells["failed"]) == (2.0, 2.0)
    assert cells["ttft p50"] == math.inf and cells["e2e p90"] == math.inf   # half the requests failed
    assert cells["tpot p50"] == math.inf and cells["itl p90"] == 30.0 and cells["out tok"] == 64.0
    cells = figures({**result, "output_lens": [64, 64, 64], "ttfts": [0.1, 0.3, 0.2],
                     "latencies": [1.1, 2.3, 1.5]}, prompts=3)
    assert cells["failed"] == 0 and cells["e2e p50"] == pytest.approx(1500.0)
    assert cells["tpot p90"] == pytest.approx(np.percentile([1000 / 63, 2000 / 63, 1300 / 63], 90))
    assert figures(None, prompts=5)["failed"] == 5.0


def test_setups_take_turns_in_an_order_that_rotates_every_rate():
    """All servers are up at once; at each rate each is measured in turn, starting one later each rate."""
    setups = ["vllm", "vllm_fp32", "kvmesh_colocated"]
    assert [turns(setups, i) for i in range(4)] == [
        ["vllm", "vllm_fp32", "kvmesh_colocated"], ["vllm_fp32", "kvmesh_colocated", "vllm"],
        ["kvmesh_colocated", "vllm", "vllm_fp32"], ["vllm", "vllm_fp32", "kvmesh_colocated"]]
    assert turns([], 2) == []


def test_vllm_data_parallel_ranks_split_the_cores_evenly():
    """vllm_dp2 binds each of vLLM's engine processes to cores of its own, as kvmesh_colocated_x2's engines
    each compute on one thread; one rank keeps every core (the setups' default)."""
    assert cores_per_rank([0, 1], 1) == "0,1"
    assert cores_per_rank([0, 1], 2) == "0|1"
    assert cores_per_rank([0, 1, 2, 3, 4], 2) == "0,1|2,3"
    with pytest.raises(ValueError, match="3 ranks"):
        cores_per_rank([0, 1], 3)
