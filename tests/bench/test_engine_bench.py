"""`kvmesh bench engine --quick --json` times the engine against transformers on SmolLM2 and tiny in one
run, and writes the contract. One file per bench: xdist spreads files, not tests, over its workers."""

from __future__ import annotations

from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_engine_bench_compares_like_dtypes_on_both_models_and_writes_the_contract(tmp_path: Path):
    result, done = quick_bench(tmp_path, "engine", timeout=600)
    assert set(result["targets"]) == {"decode_tps_ratio_b1", "decode_tps_ratio_b16", "decode_tps_ratio_b1_tiny",
                                      "decode_tps_ratio_b16_tiny", "decode_b1_step_over_floor",
                                      "prefill_bf16_over_fp32"}
    assert result["directions"]["decode_b1_step_over_floor"] == "<="   # a ceiling: at most 1.2x the floor
    paths = {row["path"] for row in result["rows"]}
    assert {"transformers bf16", "transformers fp32", "kvmesh bf16", "kvmesh bf16 4-bit decode"} <= paths
    assert {"smollm2, batch 1", "tiny, batch 16"} <= {row["compared"] for row in result["rows"]}
    assert "decode_step_floor_ms_b1_smollm2" in result["ceilings"]
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
    assert "SmolLM2 decode at batch 1" in " ".join(done.stdout.split())
