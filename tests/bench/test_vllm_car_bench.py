"""`kvmesh bench vllm_car --quick --json` runs stock vLLM with and without kvmesh's cxl tier and writes
the contract; skipped, saying why, where vLLM's virtualenv (.venv-vllm) could not be made."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench, skip_without_vllm

pytestmark = BENCH_TIMEOUT


def test_vllm_car_bench_compares_recompute_with_the_cxl_tier_and_writes_the_contract(tmp_path: Path):
    skip_without_vllm()
    result, _ = quick_bench(tmp_path, "vllm_car", timeout=600)
    assert set(result["targets"]) == {"ttft_ratio_recompute_vs_kvmesh"}
    assert {"reload_share_of_memcpy", "ttft_over_device_kvmesh"} <= result["ratios"].keys()
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
