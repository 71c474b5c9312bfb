"""`kvmesh bench sim`: the replay of a measured load is that load's requests and arrivals, exactly;
the result keeps the contract; and, end to end, `--quick --json` measures a real colocated engine."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvmesh.bench import serve
from kvmesh.bench import sim as bench_sim
from kvmesh.bench.loadgen import LoadResult, RequestResult, poisson_arrivals
from kvmesh.bench.report import BenchResult, save
from kvmesh.bench.workloads import WORKLOADS
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.step_cost import load_profile

from .quick import BENCH_TIMEOUT, quick_bench


def fake_load(rate: float, count: int, ttft: float = 0.05, tbt: float = 0.004, timed: bool = False) -> LoadResult:
    """What run_load would have recorded for serve's arxiv requests at `rate`, with made-up timings."""
    requests = WORKLOADS["arxiv"].requests(count, serve.SEED)
    arrivals = poisson_arrivals(count, rate, serve.SEED)
    results = []
    for i, (r, t) in enumerate(zip(requests, arrivals)):
        times = [ttft + k * tbt for k in range(r.max_tokens)]
        results.append(RequestResult(index=i, prompt_tokens=len(r.prompt_ids), max_tokens=r.max_tokens,
                                     arrival=float(t), ttft=ttft, e2e=times[-1], token_times=times,
                                     completion_tokens=r.max_tokens,
                                     kvmesh={"timings_ms": {"prefill_queue": 1.0, "prefill": 40.0, "transfer": 0.0,
                                                            "decode_queue": 0.0, "decode": 1e3 * (times[-1] - ttft)}}
                                     if timed else None))
    return LoadResult(rate=rate, wall_s=float(arrivals[-1]) + 1, results=results, unsent=0)


def test_the_replay_is_the_measured_loads_requests_and_arrivals():
    load = fake_load(8, 64)
    replayed = bench_sim.sim_requests(load)
    assert [(r.request_id, r.arrival, r.prompt_len, r.max_tokens) for r in replayed] == \
        [(f"r{x.index}", x.arrival, x.prompt_tokens, x.max_tokens) for x in load.results]
    sent = WORKLOADS["arxiv"].requests(64, serve.SEED)
    assert [r.prompt_len for r in replayed] == [len(s.prompt_ids) for s in sent]
    assert [r.arrival for r in replayed] == poisson_arrivals(64, 8, serve.SEED).tolist()
    late = bench_sim.sim_requests(load, delay_s=0.1)
    assert [r.arrival for r in late] == pytest.approx([r.arrival + 0.1 for r in replayed])


def test_a_delay_counts_in_the_simulated_latencies():
    load, spec, cost = fake_load(1, 8), EngineSpec(device_blocks=4096, num_layers=4), load_profile(bench_sim.PROFILE)
    plain, late = bench_sim.simulated(load, spec, cost, {}), bench_sim.simulated(load, spec, cost, {}, 0.2)
    assert late["ttft_p50_s"] == pytest.approx(plain["ttft_p50_s"] + 0.2)  # one request at a time at 1 req/s
    assert late["tpot_mean_s"] == pytest.approx(plain["tpot_mean_s"])


def test_the_step_variation_is_fitted_on_the_lightest_loads_decode():
    loads = [fake_load(rate, 16, timed=True) for rate in bench_sim.RATES]
    spec, cost = EngineSpec(device_blocks=4096, num_layers=4), load_profile(bench_sim.PROFILE)
    found = bench_sim.variations(loads, spec, cost, {})
    assert [v.suffix for v in found] == ["", "_overhead", "_step_overhead"]
    stepped = found[2]
    assert stepped.cost.a > cost.a and (stepped.cost.b, stepped.cost.c, stepped.cost.d, stepped.cost.e) == \
        (cost.b, cost.c, cost.d, cost.e)
    # 4 ms a token measured on the engine side: the simulated decode at 1 req/s now takes as long
    measured = np.mean([r.kvmesh["timings_ms"]["decode"] for r in loads[0].results])
    assert stepped.summaries[0]["stages_ms"]["decode"] == pytest.approx(measured, rel=0.02)


def test_the_result_has_every_rates_keys_and_keeps_the_contract(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loads = [fake_load(rate, 16, timed=True) for rate in bench_sim.RATES]
    spec, cost = EngineSpec(device_blocks=4096, num_layers=4), load_profile(bench_sim.PROFILE)
    found = bench_sim.variations(loads, spec, cost, {})
    result = bench_sim._result(True, serve.QUICK, loads, found, spec, {}, {"policies": {}})
    assert isinstance(result, BenchResult)
    for rate in bench_sim.RATES:
        for name in bench_sim.FIGURES:
            key = f"sim_error_{name}_colocated_{rate}"
            assert {key, f"{key}_overhead", f"{key}_step_overhead"} <= result.ratios.keys()
            assert (key in result.targets) is (name in bench_sim.TARGETED)
    assert set(result.directions.values()) == {"<="}
    assert all(not math.isnan(v) for v in result.ratios.values())
    assert result.config["engine"]["device_blocks"] == 4096
    assert Path(result.plots[0]).stat().st_size > 0
    save(result, tmp_path / "sim.json")  # JSON all the way down (no numpy scalars)



@BENCH_TIMEOUT
def test_sim_bench_measures_a_real_engine_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "sim", timeout=600)
    assert {f"sim_error_p90_e2e_colocated_{rate}" for rate in bench_sim.RATES} <= result["targets"].keys()
    assert result["config"]["engine"]["device_blocks"] > 0
    assert {row["compared"] for row in result["rows"]} >= {"measured", "simulated", "relative error"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
