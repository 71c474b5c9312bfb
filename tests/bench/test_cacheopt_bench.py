"""`kvmesh bench cacheopt --quick --json` compares CacheOpt's methods in one run and writes the contract.
One file per bench: each takes a minute or two, and xdist spreads files, not tests, over its workers."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_cacheopt_bench_compares_the_allocation_policies_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "cacheopt", timeout=600)
    assert set(result["ratios"]) == {"p99_tbt_ratio_block_vs_cacheopt", "p99_ttft_ratio_block_vs_cacheopt",
                                     "slo_attainment_cacheopt", "slo_attainment_block",
                                     "predictor_mae_ratio_rlp_vs_ours"}
    assert {row["path"] for row in result["rows"]} >= {"block", "rlp", "s3", "cacheopt"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
