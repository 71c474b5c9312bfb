"""`kvmesh bench serve --quick --json` drives real local clusters and writes the benchmark contract.
One file per bench: each takes a minute or two, and xdist spreads files, not tests, over its workers."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_serve_bench_drives_real_clusters_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "serve", timeout=600)
    assert {"p90_latency_reduction_vs_colocated", "p90_latency_reduction_vs_data_parallel",
            "transfer_share"} <= result["ratios"].keys()
    # both framings measured: (3) at half 1P1D's rate, (4) two colocated engines at the same rate
    rows = {row["compared"]: row for row in result["rows"]}
    assert {"(1) 1P1D pull", "(3) colocated", "(4) 2 colocated, data parallel"} <= rows.keys()
    assert {"failed", "e2e p90 every", "ttft p90 every"} <= rows["(1) 1P1D pull"]["cells"].keys()
    breakdown = result["config"]["breakdown_ms"]["(1) 1P1D pull / arxiv"]  # from the admission's kvmesh field
    assert set(breakdown) == {"prefill_queue", "prefill", "decode_queue", "transfer", "decode"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
