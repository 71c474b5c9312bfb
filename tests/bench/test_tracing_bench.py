"""`kvmesh bench tracing --quick --json` drives a real local cluster with tracing off and on, and
writes the benchmark contract. One file per bench, as xdist spreads files over its workers."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_tracing_bench_compares_off_and_on_and_reports_the_span_file(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "tracing", timeout=300)
    assert {"p50_overhead", "p90_overhead", "mean_overhead", "spans_per_request"} <= result["ratios"].keys()
    assert result["targets"] == {"p50_overhead": 0.03} and result["directions"] == {"p50_overhead": "<="}
    assert "untraced_e2e_p50_ms" in result["ceilings"]
    report = result["config"]["report"]  # `kvmesh report` read the traced cluster's span file
    assert report["requests"] > 0 and result["ratios"]["spans_per_request"] > 0
    assert all(Path(tmp_path / plot).stat().st_size > 0 for plot in result["plots"])
