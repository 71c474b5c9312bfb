"""`kvmesh bench vllm_cacheopt --quick --json` runs stock vLLM under KVMeshScheduler's allocation policies
and writes the contract; skipped, saying why, where vLLM's virtualenv (.venv-vllm) could not be made."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench, skip_without_vllm

pytestmark = BENCH_TIMEOUT


def test_vllm_cacheopt_bench_compares_the_allocation_policies_and_writes_the_contract(tmp_path: Path):
    skip_without_vllm()
    result, _ = quick_bench(tmp_path, "vllm_cacheopt", timeout=600)
    assert set(result["targets"]) == {"p99_tbt_ratio_block_vs_cacheopt", "p99_ttft_ratio_block_vs_cacheopt"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
