"""`kvmesh bench kvmeta` and `transfer --quick --json` run and write the benchmark contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .quick import BENCH_TIMEOUT, quick_bench

pytestmark = BENCH_TIMEOUT


def test_kvmeta_bench_writes_the_contract(tmp_path: Path):
    result, done = quick_bench(tmp_path, "kvmeta", timeout=120)
    assert {"hop_added_ms_p50", "hop_added_ms_p99", "lookup_ratio_http_vs_redis"} <= result["ratios"].keys()
    assert "redis_ping_p50_ms" in result["ceilings"]
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
    assert "HTTP hop alone adds" in done.stdout


def test_unknown_bench_is_refused():
    done = subprocess.run([sys.executable, "-m", "kvmesh", "bench", "nothing"], capture_output=True, text=True)
    assert done.returncode == 2 and "no benchmark 'nothing'" in done.stderr


def test_transfer_bench_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "transfer", timeout=600)
    assert {"pull_vs_message_4k", "pull_vs_nocoalesce_4k", "tcp_frac_of_ceiling", "shm_frac_of_ceiling"} <= result["ratios"].keys()
    # The target is against batched message passing; each peer's targets stay, missed, when it is not installed.
    peers = {f"pull_vs_{peer}_{at}" for peer in ("mooncake_tcp", "nixl", "nixl_tcp") for at in ("4k", "min")}
    assert set(result["targets"]) == {"pull_vs_message_batched_4k", "tcp_frac_of_ceiling", "shm_frac_of_ceiling", *peers}
    for peer in result["config"]["peers_skipped"]:
        assert result["meets"][f"pull_vs_{peer}_min"] is False
    assert {"memcpy_gbps", "socket_gbps"} <= result["ceilings"].keys()
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
