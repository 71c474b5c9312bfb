"""`kvmesh bench serve` and `tracing --quick --json` drive real local clusters and write the
benchmark contract."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_serve_bench_drives_real_clusters_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "serve", timeout=600)
    assert {"p90_latency_reduction_vs_colocated", "transfer_share"} <= result["ratios"].keys()
    assert set(result["meets"]) == set(result["targets"])
    breakdown = result["config"]["breakdown_ms"]["(1) 1P1D pull / arxiv"]  # from the admission's kvmesh field
    assert set(breakdown) == {"prefill_queue", "prefill", "decode_queue", "transfer", "decode"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0


def test_tracing_bench_compares_off_and_on_and_reports_the_span_file(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "tracing", timeout=300)
    assert {"p50_overhead", "p90_overhead", "mean_overhead", "spans_per_request"} <= result["ratios"].keys()
    assert result["targets"] == {"p50_overhead": 0.03} and set(result["meets"]) == set(result["targets"])
    assert "untraced_e2e_p50_ms" in result["ceilings"]
    report = result["config"]["report"]  # `kvmesh report` read the traced cluster's span file
    assert report["requests"] > 0 and result["ratios"]["spans_per_request"] > 0
    assert all(Path(tmp_path / plot).stat().st_size > 0 for plot in result["plots"])
