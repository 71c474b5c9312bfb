"""`kvmesh bench vllm`'s rule, on made-up figures (its run starts 5 setups x 3 rates of fresh vLLM
instance pairs, about 7.5 minutes even with --quick: more than the suite can spend on one bench).
Which rate carries each key, NIXL's keys when NIXL is absent, and the direction of its targets."""

from __future__ import annotations

import math

import pytest

from kvmesh.bench.report import judge
from kvmesh.bench.vllm import SETUPS, TARGETS, keys

RATES = (1.0, 3.0, 5.0)


def figures(p90: dict[str, list[float]], colocated_tbt: list[float]) -> dict:
    out = {(setup, rate): {"P90 latency ms": v, "mean TBT ms": 10.0, "hand-off GB/s": 1.0 + i}
           for i, (setup, values) in enumerate(p90.items()) for rate, v in zip(RATES, values)}
    for rate, tbt in zip(RATES, colocated_tbt):
        out["colocated", rate]["mean TBT ms"] = tbt
    return out


def test_peers_are_compared_at_the_highest_rate_no_pd_setup_collapsed_and_every_rate_is_reported():
    measured = figures({"kvmesh": [100, 150, 400], "kvmesh_shm": [90, 140, 250], "nixl": [150, 240, 900],
                        "example": [300, 500, 800], "colocated": [120, 300, 2000]}, colocated_tbt=[10, 15, 25])
    ratios = keys(measured, list(SETUPS), RATES)
    # at 5 req/s kvmesh is past 3x its own P90 at 1 (400 > 300) and nixl too: the peers' rate is 3
    assert ratios["peers_rate"] == 3.0
    assert ratios["p90_latency_ratio_nixl_vs_kvmesh"] == pytest.approx(240 / 150)
    assert ratios["p90_latency_ratio_example_vs_kvmesh_shm"] == pytest.approx(500 / 140)
    assert [ratios[f"p90_latency_ratio_nixl_vs_kvmesh_at_{r:g}"] for r in RATES] == pytest.approx([1.5, 1.6, 2.25])
    # colocated's mean TBT first doubles its own at 5 req/s: KVDirect's framing is read there
    assert ratios["colocated_rate"] == 5.0
    assert ratios["p90_latency_reduction_vs_colocated"] == pytest.approx(1 - 400 / 2000)
    assert ratios["kv_gbps_nixl"] == 3.0 and ratios["kv_gbps_kvmesh"] == 1.0
    assert judge(ratios, TARGETS, {"p90_latency_ratio_nixl_vs_kvmesh": ">"}) == {
        "p90_latency_ratio_nixl_vs_kvmesh": True, "p90_latency_reduction_vs_colocated": True}


def test_without_nixl_its_keys_are_nan_and_its_target_is_missed_not_dropped():
    setups = [s for s in SETUPS if s != "nixl"]
    measured = figures({"kvmesh": [100, 110, 120], "kvmesh_shm": [90, 100, 110], "example": [300, 320, 340],
                        "colocated": [120, 130, 140]}, colocated_tbt=[10, 11, 12])
    ratios = keys(measured, setups, RATES)
    assert ratios["peers_rate"] == 5.0 and ratios["colocated_rate"] == 5.0   # nothing collapsed or doubled
    assert math.isnan(ratios["p90_latency_ratio_nixl_vs_kvmesh"]) and math.isnan(ratios["kv_gbps_nixl"])
    assert judge(ratios, TARGETS, {"p90_latency_ratio_nixl_vs_kvmesh": ">"})["p90_latency_ratio_nixl_vs_kvmesh"] is False
    assert set(TARGETS) <= set(ratios)


def test_one_pd_setup_collapsing_at_every_rate_past_the_first_puts_the_peers_at_the_lowest():
    measured = figures({"kvmesh": [100, 400, 900], "kvmesh_shm": [100, 120, 130], "nixl": [100, 110, 120],
                        "example": [100, 110, 120], "colocated": [100, 110, 120]}, colocated_tbt=[10, 11, 12])
    assert keys(measured, list(SETUPS), RATES)["peers_rate"] == 1.0
