"""`kvmesh bench car --quick --json` compares CaR's methods in one run and writes the contract.
One file per bench: each takes a minute or two, and xdist spreads files, not tests, over its workers."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_car_bench_compares_recompute_lru_and_car_with_and_without_prefetch(tmp_path: Path):
    result, done = quick_bench(tmp_path, "car", timeout=300)
    assert {"ttft_reduction_vs_recompute", "ttft_ratio_lru_vs_car"} == set(result["targets"])
    assert {"ttft_reduction_vs_recompute", "ttft_ratio_lru_vs_car", "hit_ratio_device",
            "hit_ratio_cxl"} <= result["ratios"].keys()
    assert "reload_gbps" in result["ceilings"]
    assert {row["path"] for row in result["rows"]} >= {"recompute", "lru", "car", "car+prefetch", "+sparsify"}
    assert {"sparsify_reload_bytes_ratio_dense_vs_sparse", "sparsify_quality_cost_nats"} <= result["ratios"].keys()
    assert len(result["plots"]) == 2 and all(Path(tmp_path / plot).stat().st_size > 0 for plot in result["plots"])
    assert "lower than recomputing" in " ".join(done.stdout.split())
