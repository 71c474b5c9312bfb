"""The paper policies' benchmarks (`cacheopt`, `layerkv`, `car --quick --json`) compare their
methods in one run and write the contract."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_cacheopt_bench_compares_the_allocation_policies_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "cacheopt", timeout=600)
    assert set(result["ratios"]) == {"p99_tbt_ratio_block_vs_cacheopt", "p99_ttft_ratio_block_vs_cacheopt",
                                     "slo_attainment_cacheopt", "slo_attainment_block",
                                     "predictor_mae_ratio_rlp_vs_ours"}
    assert set(result["meets"]) == set(result["targets"])
    assert {row["path"] for row in result["rows"]} >= {"block", "rlp", "s3", "cacheopt"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0


def test_layerkv_bench_compares_fcfs_and_layerkv_with_and_without_its_scheduler(tmp_path: Path):
    result, done = quick_bench(tmp_path, "layerkv", timeout=300)
    assert {"mean_ttft_ratio_fcfs_vs_layerkv", "throughput_ratio_layerkv_vs_fcfs",
            "violation_rate_drop"} == set(result["targets"]) <= result["ratios"].keys()
    assert set(result["meets"]) == set(result["targets"])
    assert {"memcpy_gbps", "engine_device_to_cxl_gbps"} <= result["ceilings"].keys()
    assert {row["path"] for row in result["rows"]} == {"fcfs", "layerkv-noslo", "layerkv"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
    assert "points fewer SLO violations" in " ".join(done.stdout.split())  # the headline, however rich wraps it


def test_car_bench_compares_recompute_lru_and_car_with_and_without_prefetch(tmp_path: Path):
    result, done = quick_bench(tmp_path, "car", timeout=300)
    assert {"ttft_reduction_vs_recompute", "ttft_ratio_lru_vs_car"} == set(result["targets"])
    assert {"ttft_reduction_vs_recompute", "ttft_ratio_lru_vs_car", "hit_ratio_device",
            "hit_ratio_cxl"} <= result["ratios"].keys()
    assert set(result["meets"]) == set(result["targets"]) and "reload_gbps" in result["ceilings"]
    assert {row["path"] for row in result["rows"]} >= {"recompute", "lru", "car", "car+prefetch", "+sparsify"}
    assert {"sparsify_reload_bytes_ratio_dense_vs_sparse", "sparsify_quality_cost_nats"} <= result["ratios"].keys()
    assert len(result["plots"]) == 2 and all(Path(tmp_path / plot).stat().st_size > 0 for plot in result["plots"])
    assert "lower than recomputing" in " ".join(done.stdout.split())
