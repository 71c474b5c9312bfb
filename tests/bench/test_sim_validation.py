"""`kvmesh bench sim`: the replay of a measured load is that load's requests and arrivals, exactly;
the profile is calibrated on a load of its own (the engine's recorded steps, the client's timings
against the engine's); each variation changes one assumption; the result keeps the contract; and, end
to end, `--quick --json` calibrates on and measures a real colocated engine."""

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
from kvmesh.sim.request_path import RequestPath
from kvmesh.sim.step_cost import StepCost, load_profile

from .quick import BENCH_TIMEOUT, quick_bench

SPEC = EngineSpec(device_blocks=4096, num_layers=4)
TRUTH = StepCost(a=2e-3, b=5e-5, c=8e-5, d=3e-7, e=1e-7)


def fake_load(rate: float, count: int, ttft: float = 0.05, tbt: float = 0.004, engine_ttft: float = 0.041,
              timed: bool = False) -> LoadResult:
    """What run_load would have recorded for serve's arxiv requests at `rate`, with made-up timings:
    the engine's own arrival-to-first-token `engine_ttft`, its decode the client's."""
    requests = WORKLOADS["arxiv"].requests(count, serve.SEED)
    arrivals = poisson_arrivals(count, rate, serve.SEED)
    results = []
    for i, (r, t) in enumerate(zip(requests, arrivals)):
        times = [ttft + k * tbt for k in range(r.max_tokens)]
        timings = {"prefill_queue": 1.0, "prefill": engine_ttft * 1e3 - 1.0, "transfer": 0.0, "decode_queue": 0.0,
                   "decode": 1e3 * (times[-1] - ttft)}
        results.append(RequestResult(index=i, prompt_tokens=len(r.prompt_ids), max_tokens=r.max_tokens,
                                     arrival=float(t), ttft=ttft, e2e=times[-1], token_times=times,
                                     completion_tokens=r.max_tokens, kvmesh={"timings_ms": timings} if timed else None))
    return LoadResult(rate=rate, wall_s=float(arrivals[-1]) + 1, results=results, unsent=0)


def recorded_steps(count: int, cost: StepCost = TRUTH, seed: int = 0) -> list[dict]:
    """Steps as GET /v1/steps lists them, each taking what `cost` says of its shape."""
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(count):
        shape = (int(rng.integers(0, 512)), int(rng.integers(0, 16)), int(rng.integers(0, 20_000)),
                 int(rng.integers(0, 100_000)))
        steps.append({"index": i + 1, "end": float(i), "seconds": cost.seconds(*shape),
                      **dict(zip(("prefill_tokens", "decode_tokens", "decode_context", "prefill_context"), shape))})
    return steps


def scaled(cost: StepCost, factor: float) -> StepCost:
    return StepCost(*(factor * getattr(cost, t) for t in ("a", "b", "c", "d", "e")))


def test_the_replay_is_the_measured_loads_requests_and_arrivals():
    load = fake_load(8, 64)
    replayed = bench_sim.sim_requests(load)
    assert [(r.request_id, r.arrival, r.prompt_len, r.max_tokens) for r in replayed] == \
        [(f"r{x.index}", x.arrival, x.prompt_tokens, x.max_tokens) for x in load.results]
    sent = WORKLOADS["arxiv"].requests(64, serve.SEED)
    assert [r.prompt_len for r in replayed] == [len(s.prompt_ids) for s in sent]
    assert [r.arrival for r in replayed] == poisson_arrivals(64, 8, serve.SEED).tolist()


def test_the_path_counts_in_the_simulated_latencies():
    load, cost = fake_load(1, 8), load_profile(bench_sim.PROFILE)
    plain = bench_sim.simulated(load, SPEC, cost, {})
    late = bench_sim.simulated(load, SPEC, cost, {}, RequestPath(first_token_s=0.2, last_token_lag_s=0.01))
    assert late["ttft_p50_s"] == pytest.approx(plain["ttft_p50_s"] + 0.2)  # one request at a time at 1 req/s
    assert late["e2e_p90_s"] == pytest.approx(plain["e2e_p90_s"] + 0.21)
    assert late["tpot_mean_s"] > plain["tpot_mean_s"]
    assert late["stages_ms"] == plain["stages_ms"]  # the engine side is the engine's alone


def test_the_calibration_is_its_own_loads_steps_and_path():
    calibration = bench_sim.calibrate(fake_load(6, 16, ttft=0.05, engine_ttft=0.041, timed=True), recorded_steps(80))
    for term in ("a", "b", "c", "d", "e"):
        assert getattr(calibration.cost, term) == pytest.approx(getattr(TRUTH, term), rel=1e-6)
    assert calibration.path.first_token_s == pytest.approx(0.009)
    assert calibration.path.last_token_lag_s == pytest.approx(0.0, abs=1e-12)


def test_each_variation_changes_one_assumption():
    loads = [fake_load(rate, 16, engine_ttft=0.03 + 0.001 * rate, timed=True) for rate in bench_sim.RATES]
    steps = [recorded_steps(40, scaled(TRUTH, 1 + 0.1 * i), seed=i) for i in range(len(loads))]
    calibration = bench_sim.calibrate(fake_load(6, 16, timed=True), recorded_steps(80))
    in_process = load_profile(bench_sim.PROFILE)
    found = {v.suffix: v for v in bench_sim.variations(calibration, loads, steps, SPEC, in_process, {})}
    assert list(found) == ["", "_in_process", "_no_path", "_own_steps", "_own_path", "_own"]
    assert found["_own"].costs == found["_own_steps"].costs and found["_own"].paths == found["_own_path"].paths
    assert found[""].costs == [calibration.cost] * 4 and found[""].paths == [calibration.path] * 4
    assert found["_in_process"].costs == [in_process] * 4 and found["_in_process"].paths == [RequestPath()] * 4
    assert found["_no_path"].paths == [RequestPath()] * 4
    assert [c.a for c in found["_own_steps"].costs] == pytest.approx([TRUTH.a * (1 + 0.1 * i) for i in range(4)])
    assert [p.first_token_s for p in found["_own_path"].paths] == \
        pytest.approx([0.05 - 0.03 - 0.001 * rate for rate in bench_sim.RATES])
    assert bench_sim.step_time_ratio(TRUTH, steps[2]) == pytest.approx(1.2)


def test_the_result_has_every_rates_keys_and_keeps_the_contract(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loads = [fake_load(rate, 16, timed=True) for rate in bench_sim.RATES]
    steps = [recorded_steps(40, seed=i) for i in range(len(loads))]
    calibration = bench_sim.calibrate(fake_load(6, 16, timed=True), recorded_steps(80))
    found = bench_sim.variations(calibration, loads, steps, SPEC, load_profile(bench_sim.PROFILE), {})
    result = bench_sim._result(True, serve.QUICK, calibration, loads, steps, found, SPEC, {}, {"policies": {}})
    assert isinstance(result, BenchResult)
    for rate in bench_sim.RATES:
        for name in bench_sim.FIGURES:
            key = f"sim_error_{name}_colocated_{rate}"
            assert {key, *(f"{key}{v.suffix}" for v in found)} <= result.ratios.keys()
            assert (key in result.targets) is (name in bench_sim.TARGETED)
    assert set(result.directions.values()) == {"<="}
    assert all(not math.isnan(v) for v in result.ratios.values())
    assert result.config["engine"]["device_blocks"] == 4096
    assert result.config["calibration"]["rate_rps"] == bench_sim.CALIBRATION_RATE
    assert result.config["step_time_ratio"]["calibrated"] == pytest.approx([1.0] * 4)
    assert Path(result.plots[0]).stat().st_size > 0
    save(result, tmp_path / "sim.json")  # JSON all the way down (no numpy scalars)
    bench_sim.write_served_profile(calibration, tmp_path / "served.json")
    assert load_profile(str(tmp_path / "served.json")) == calibration.cost


@BENCH_TIMEOUT
def test_sim_bench_measures_a_real_engine_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "sim", timeout=600)
    assert {f"sim_error_p90_e2e_colocated_{rate}" for rate in bench_sim.RATES} <= result["targets"].keys()
    assert result["config"]["engine"]["device_blocks"] > 0
    assert result["config"]["calibration"]["steps"] > 0
    assert {row["compared"] for row in result["rows"]} >= {"measured", "simulated", "relative error"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
