"""`kvmesh bench layerkv --quick --json` compares LayerKV's methods in one run and writes the contract,
with LayerKV's decodes in the `--layer-decode` mode asked (the quick run: stage; bench sim_layerkv's
test runs the default, restore). One file per bench: each takes a minute or two, and xdist spreads
files, not tests, over its workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_layerkv_bench_compares_fcfs_and_layerkv_with_and_without_its_scheduler(tmp_path: Path):
    result, done = quick_bench(tmp_path, "layerkv", 300, "--layer-decode", "stage")
    assert result["config"]["layer_decode"] == result["config"]["engine"]["layer_decode"] == "stage"
    assert {"mean_ttft_ratio_fcfs_vs_layerkv", "throughput_ratio_layerkv_vs_fcfs",
            "violation_rate_drop"} == set(result["targets"]) <= result["ratios"].keys()
    assert {"memcpy_gbps", "engine_device_to_cxl_gbps"} <= result["ceilings"].keys()
    # B's key at the rate the rule picks, and every rate's drop beside it (quick: one rate); the device
    # tier against each part's longest request; the predictor that told the engine the lengths.
    assert result["ratios"]["violation_rate_drop"] == result["ratios"]["violation_rate_drop_at_3x"]
    assert {"device_tier_over_longest_a", "device_tier_over_longest_b",
            "predictor_mae_ratio_mean_vs_ours_b"} <= result["ratios"].keys()
    assert result["config"]["predictor_b"]["by_rate"][0]["confidence"] > 0
    assert {row["path"] for row in result["rows"]} == {"fcfs", "layerkv-noslo", "layerkv"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
    assert "points fewer SLO violations" in " ".join(done.stdout.split())  # the headline, however rich wraps it


def test_layer_decode_is_a_choice_of_two_for_the_layerkv_benches_only():
    for args in (("layerkv", "--layer-decode", "keep"), ("kvmeta", "--layer-decode", "stage")):
        done = subprocess.run([sys.executable, "-m", "kvmesh", "bench", *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, done.stderr
    assert "--layer-decode is for `layerkv` and `sim_layerkv` only, not 'kvmeta'" in done.stderr
