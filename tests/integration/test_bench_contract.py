"""`kvmesh bench kvmeta --quick --json` runs and writes the benchmark contract (values are not judged here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

# Each benchmark runs under its own subprocess timeout below (up to 600 s: a slower CPU, say one
# without AVX-512, takes the cacheopt benchmark past the suite's 120 s default).
pytestmark = pytest.mark.timeout(660)


def quick_bench(tmp_path: Path, name: str, timeout: float) -> tuple[dict, subprocess.CompletedProcess]:
    """`kvmesh bench NAME --quick --json`, run as a user would; its JSON and the run."""
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "kvmesh", "bench", name, "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = msgspec.json.decode(out.read_bytes())
    assert result["bench"] == name and result["quick"] is True
    return result, done


def test_kvmeta_bench_writes_the_contract(tmp_path: Path):
    result, done = quick_bench(tmp_path, "kvmeta", timeout=120)
    assert {"hop_added_ms_p50", "hop_added_ms_p99", "lookup_ratio_http_vs_redis"} <= result["ratios"].keys()
    assert set(result["meets"]) == set(result["targets"]) and "redis_ping_p50_ms" in result["ceilings"]
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
    assert "HTTP hop alone adds" in done.stdout


def test_unknown_bench_is_refused():
    done = subprocess.run([sys.executable, "-m", "kvmesh", "bench", "nothing"], capture_output=True, text=True)
    assert done.returncode == 2 and "no benchmark 'nothing'" in done.stderr


def test_transfer_bench_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "transfer", timeout=600)
    assert {"pull_vs_message_4k", "pull_vs_nocoalesce_4k", "tcp_frac_of_ceiling", "shm_frac_of_ceiling"} <= result["ratios"].keys()
    assert {"memcpy_gbps", "socket_gbps"} <= result["ceilings"].keys()
    assert set(result["meets"]) == set(result["targets"])
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0


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


def test_cacheopt_bench_compares_the_allocation_policies_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "cacheopt", timeout=600)
    assert set(result["ratios"]) == {"p99_tbt_ratio_block_vs_cacheopt", "p99_ttft_ratio_block_vs_cacheopt",
                                     "slo_attainment_cacheopt", "slo_attainment_block",
                                     "predictor_mae_ratio_rlp_vs_ours"}
    assert set(result["meets"]) == set(result["targets"])
    assert {row["path"] for row in result["rows"]} >= {"block", "rlp", "s3", "cacheopt"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0


def test_layerkv_bench_compares_fcfs_and_layerkv_with_and_without_its_scheduler(tmp_path: Path):
    result, done = quick_bench(tmp_path, "layerkv", timeout=300)
    assert {"mean_ttft_ratio_fcfs_vs_layerkv", "throughput_ratio_layerkv_vs_fcfs",
            "violation_rate_drop"} == set(result["targets"]) <= result["ratios"].keys()
    assert set(result["meets"]) == set(result["targets"])
    assert {"memcpy_gbps", "engine_device_to_cxl_gbps"} <= result["ceilings"].keys()
    assert {row["path"] for row in result["rows"]} == {"fcfs", "layerkv-noslo", "layerkv"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
    assert "points fewer SLO violations" in " ".join(done.stdout.split())  # the headline, however rich wraps it


def test_car_bench_compares_recompute_lru_and_car_with_and_without_prefetch(tmp_path: Path):
    result, done = quick_bench(tmp_path, "car", timeout=300)
    assert {"ttft_reduction_vs_recompute", "ttft_ratio_lru_vs_car"} == set(result["targets"])
    assert {"ttft_reduction_vs_recompute", "ttft_ratio_lru_vs_car", "hit_ratio_device",
            "hit_ratio_cxl"} <= result["ratios"].keys()
    assert set(result["meets"]) == set(result["targets"]) and "reload_gbps" in result["ceilings"]
    assert {row["path"] for row in result["rows"]} >= {"recompute", "lru", "car", "car+prefetch", "+sparsify"}
    assert {"sparsify_reload_bytes_ratio_dense_vs_sparse", "sparsify_quality_cost_nats"} <= result["ratios"].keys()
    assert len(result["plots"]) == 2 and all(Path(tmp_path / plot).stat().st_size > 0 for plot in result["plots"])
    assert "lower than recomputing" in " ".join(done.stdout.split())
