"""`kvmesh bench sim`: the replay of a measured load is that load's requests and arrivals, exactly;
the profile is calibrated on a load of its own (each engine's recorded steps, the client's timings
against the engines'); each variation changes one assumption; 1P1D is a prefill and a decode engine;
the result keeps the contract; and, end to end, `--quick --json` calibrates on and measures a real
colocated engine and a real 1P1D pair."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from kvmesh.bench import serve
from kvmesh.bench import sim as bench_sim
from kvmesh.bench.loadgen import LoadResult, RequestResult, poisson_arrivals
from kvmesh.bench.report import BenchResult, save
from kvmesh.bench.sim_serve_calibration import (calibrate, measured_link, measured_path, served_profile_path,
                                               write_served_profiles)
from kvmesh.bench.sim_serving import kv_geometry, sim_engines
from kvmesh.bench.sim_validation import calibration_fit, six_term_fit, step_time_ratio
from kvmesh.bench.workloads import WORKLOADS
from kvmesh.policies.step_shape import FIELDS
from kvmesh.services.engine.model_source import DEFAULT_MODEL
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.link import KVGeometry, LinkSpec, pull
from kvmesh.sim.request_path import RequestPath
from kvmesh.sim.step_cost import TERMS, StepCost, load_profile
from kvmesh.sim.topology import Topology

from .quick import BENCH_TIMEOUT, quick_bench

SPEC = EngineSpec(device_blocks=4096, num_layers=4)
TRUTH = StepCost(a=2e-3, b=5e-5, c=8e-5, d=3e-7, e=1e-7)  # five terms, as the benches calibrate (f held at 0)


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
                 int(rng.integers(0, 100_000)), int(rng.integers(0, 8)))
        steps.append({"index": i + 1, "end": float(i), "seconds": cost.seconds(*shape),
                      **dict(zip(FIELDS, shape))})
    return steps


def test_the_replay_is_the_measured_loads_requests_and_arrivals():
    load = fake_load(8, 64)
    replayed = bench_sim.sim_requests(load)
    assert [(r.request_id, r.arrival, r.prompt_len, r.max_tokens) for r in replayed] == \
        [(f"r{x.index}", x.arrival, x.prompt_tokens, x.max_tokens) for x in load.results]
    sent = WORKLOADS["arxiv"].requests(64, serve.SEED)
    assert [r.prompt_len for r in replayed] == [len(s.prompt_ids) for s in sent]
    assert [r.arrival for r in replayed] == poisson_arrivals(64, 8, serve.SEED).tolist()


COLOCATED = {"engine-c0": ("both", SPEC, {})}
STATE = {"total_blocks": {"device": 4096}, "block_size": 16, "max_num_seqs": 256, "token_budget": 2048,
         "policies": {}}


def measured(configuration: bench_sim.Configuration, rates=bench_sim.TINY.rates, state=STATE) -> bench_sim.Measured:
    """A made-up run of a configuration: timed loads, each engine's GET /v1/state `state`, and each
    engine's steps taken as TRUTH says."""
    engines = list(Topology.parse(configuration.topology).roles())
    return bench_sim.Measured(configuration, dict.fromkeys(engines, state), fake_load(6, 16, timed=True),
                              {e: recorded_steps(80, seed=k) for k, e in enumerate(engines)},
                              [fake_load(rate, 16, engine_ttft=0.03 + 0.001 * rate, timed=True) for rate in rates],
                              [{e: recorded_steps(40, scaled(TRUTH, 1 + 0.1 * i), seed=i) for e in engines}
                               for i in range(len(rates))])


def scaled(cost: StepCost, factor: float) -> StepCost:
    return StepCost(*(factor * getattr(cost, t) for t in TERMS))


def test_the_path_counts_in_the_simulated_latencies():
    load, cost = fake_load(1, 8), {"engine-c0": load_profile(bench_sim.TINY.in_process)}
    plain = bench_sim.simulated(load, COLOCATED, cost)
    late = bench_sim.simulated(load, COLOCATED, cost, RequestPath(first_token_s=0.2, last_token_lag_s=0.01))
    assert late["ttft_p50_s"] == pytest.approx(plain["ttft_p50_s"] + 0.2)  # one request at a time at 1 req/s
    assert late["e2e_p90_s"] == pytest.approx(plain["e2e_p90_s"] + 0.21)
    assert late["tpot_mean_s"] > plain["tpot_mean_s"]
    assert late["stages_ms"] == plain["stages_ms"]  # the engine side is the engine's alone


def test_the_calibration_is_its_own_loads_steps_and_path():
    calibration = calibrate(fake_load(6, 16, ttft=0.05, engine_ttft=0.041, timed=True),
                            {"engine-p0": recorded_steps(80), "engine-d0": recorded_steps(60, seed=1)}, KVGeometry(), 16)
    for cost in calibration.costs.values():
        for term in TERMS:
            assert getattr(cost, term) == pytest.approx(getattr(TRUTH, term), rel=1e-6, abs=1e-15)
    assert calibration.path.first_token_s == pytest.approx(0.009)
    assert calibration.path.last_token_lag_s == pytest.approx(0.0, abs=1e-12)


def test_a_split_requests_path_holds_its_hop_to_the_decode_engine_and_not_its_wait_there():
    load = fake_load(4, 16, timed=True)
    for i, r in enumerate(load.results):
        timings = r.kvmesh["timings_ms"]
        timings["decode_queue"] = 2.0 + 50.0 * (i % 4)  # the hop 2 ms, then a wait for blocks and a step of 0-150
        r.e2e += timings["decode_queue"] / 1e3 + 0.001  # and 1 ms more to relay the last token
    path = measured_path(load)
    assert path.last_token_lag_s == pytest.approx(0.003)
    assert path.last_token_lag_per_request_s == pytest.approx(0.0, abs=1e-12)


def test_the_link_is_the_line_through_the_split_requests_transfers_against_their_kv_bytes():
    geometry = KVGeometry(num_layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M's
    load = fake_load(4, 16, timed=True)
    for r in load.results:
        kv_bytes = -(-r.prompt_tokens // 16) * 30 * geometry.block_bytes(16)
        r.kvmesh["timings_ms"]["transfer"] = 1e3 * (0.002 + kv_bytes / 0.5e9)
    link = measured_link(load, geometry, 16)
    assert link.gbps == pytest.approx(0.5)
    assert [pull(link, geometry, 16, r.prompt_tokens).seconds for r in load.results] == \
        pytest.approx([r.kvmesh["timings_ms"]["transfer"] / 1e3 for r in load.results])
    assert measured_link(fake_load(4, 16, timed=True), geometry, 16) == LinkSpec()  # nothing split: the defaults
    for r in load.results:  # transfers of 8 ms whatever their size: the defaults' bandwidth, the rest latency
        r.kvmesh["timings_ms"]["transfer"] = 8.0
    flat = measured_link(load, geometry, 16)
    assert flat.gbps == LinkSpec().gbps
    assert np.mean([pull(flat, geometry, 16, r.prompt_tokens).seconds for r in load.results]) == pytest.approx(0.008)


def test_a_run_whose_engines_use_other_blocks_has_its_link_priced_in_them(monkeypatch):
    monkeypatch.setenv("KVMESH_ENGINE_BLOCK_SIZE", "16")  # this process's configuration: the engines' state wins
    run = measured(bench_sim.CONFIGURATIONS[1], state=STATE | {"block_size": 32})
    geometry = kv_geometry("tiny")
    load = run.calibration_load
    for r in load.results:
        kv_bytes = -(-r.prompt_tokens // 32) * geometry.num_layers * geometry.block_bytes(32)
        r.kvmesh["timings_ms"]["transfer"] = 1e3 * (0.002 + kv_bytes / 0.5e9)
    link = bench_sim.calibrated(run, "tiny").link
    assert link.gbps == pytest.approx(0.5)
    assert [pull(link, geometry, 32, r.prompt_tokens).seconds for r in load.results] == \
        pytest.approx([r.kvmesh["timings_ms"]["transfer"] / 1e3 for r in load.results])
    engines = sim_engines(run.configuration.topology, run.states, "tiny")
    assert {spec.block_size for _, spec, _ in engines.values()} == {32}  # the replay pulls in the same blocks
    assert measured_link(load, geometry, 16).gbps != pytest.approx(0.5)  # kvmesh up's default would misprice it


def test_a_calibration_load_that_left_an_engine_without_steps_says_so():
    load = fake_load(6, 16)
    load.results[0].error = "timeout"
    with pytest.raises(RuntimeError, match=r"engine-d0 recorded 0 steps .* 1 of 16 requests failed"):
        calibrate(load, {"engine-p0": recorded_steps(80), "engine-d0": []}, KVGeometry(), 16)


def test_the_benches_calibrate_five_terms_and_their_with_f_variation_fits_six():
    six_terms = dataclasses.replace(TRUTH, f=3e-3)
    steps = recorded_steps(80, six_terms)
    five, fit = calibration_fit(steps)
    assert five.f == 0 and "f" in fit["held_at_zero"]
    six = six_term_fit(steps)
    assert [getattr(six, t) for t in TERMS] == pytest.approx([getattr(six_terms, t) for t in TERMS], rel=1e-6)


def test_each_variation_changes_one_assumption():
    run = measured(bench_sim.CONFIGURATIONS[0])
    calibration = bench_sim.calibrated(run, "tiny")
    in_process = load_profile(bench_sim.TINY.in_process)
    found = {v.suffix: v for v in bench_sim.variations(calibration, run, "tiny", in_process)}
    assert list(found) == ["", "_constant_path", "_in_process", "_no_path", "_default_link", "_with_f", "_own_steps",
                           "_own_path", "_own"]
    assert found["_in_process"].link == found["_default_link"].link == LinkSpec()
    assert {v.link for s, v in found.items() if s not in ("_in_process", "_default_link")} == {calibration.link}
    assert found["_with_f"].paths == [calibration.path] * 4
    assert found["_constant_path"].paths == \
        [RequestPath(calibration.path.first_token_s, calibration.path.last_token_lag_s)] * 4
    assert found[""].costs == [calibration.costs] * 4 and found[""].paths == [calibration.path] * 4
    assert found["_in_process"].costs == [{"engine-c0": in_process}] * 4
    assert found["_in_process"].paths == found["_no_path"].paths == [RequestPath()] * 4
    assert [c["engine-c0"].a for c in found["_own_steps"].costs] == \
        pytest.approx([TRUTH.a * (1 + 0.1 * i) for i in range(4)])
    assert [p.first_token_s for p in found["_own_path"].paths] == \
        pytest.approx([0.05 - 0.03 - 0.001 * rate for rate in bench_sim.TINY.rates])
    assert found["_own"].costs == found["_own_steps"].costs and found["_own"].paths == found["_own_path"].paths
    assert step_time_ratio(TRUTH, run.load_steps[2]["engine-c0"]) == pytest.approx(1.2)


def test_1p1d_is_a_prefill_and_a_decode_engine_each_with_the_limits_its_state_reports(monkeypatch):
    monkeypatch.setenv("KVMESH_ENGINE_TOKEN_BUDGET", "64")  # this process's configuration: the engines' state wins
    run = measured(bench_sim.CONFIGURATIONS[1])
    run.states["engine-p0"] = STATE | {"token_budget": 512, "max_num_seqs": 8}
    engines = sim_engines(run.configuration.topology, run.states, "tiny")
    assert {e: (role, spec.token_budget, spec.max_num_seqs) for e, (role, spec, _) in engines.items()} == \
        {"engine-p0": ("prefill", 512, 8), "engine-d0": ("decode", 2048, 256)}
    load = fake_load(4, 16)
    split = bench_sim.simulated(load, engines, dict.fromkeys(engines, TRUTH))
    assert split["unfinished"] == 0 and split["steps"]["engine-p0"] > 0 and split["steps"]["engine-d0"] > 0
    assert split["transfer_mean_s"] > 0


def test_the_result_has_every_configurations_and_rates_keys_and_keeps_the_contract(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    in_process = load_profile(bench_sim.TINY.in_process)
    replayed = []
    for configuration in bench_sim.CONFIGURATIONS:
        run = measured(configuration)
        calibration = bench_sim.calibrated(run, "tiny")
        replayed.append((run, calibration, bench_sim.variations(calibration, run, "tiny", in_process)))
        write_served_profiles("tiny", configuration.key, configuration.setup.label, calibration)
        for engine_id, cost in calibration.costs.items():
            assert load_profile(str(served_profile_path("tiny", configuration.key, engine_id))) == cost
    result = bench_sim._result(True, bench_sim.TINY, serve.QUICK, replayed, in_process)
    assert isinstance(result, BenchResult)
    suffixes = [v.suffix for v in replayed[0][2]]
    for configuration in ("colocated", "1p1d"):
        for rate in bench_sim.TINY.rates:
            for name in bench_sim.FIGURES:
                key = f"sim_error_{name}_{configuration}_{rate}"
                assert {key, *(f"{key}{suffix}" for suffix in suffixes)} <= result.ratios.keys()
                assert (key in result.targets) is (name in bench_sim.TARGETED)
    assert set(result.directions.values()) == {"<="}
    assert all(not math.isnan(v) for v in result.ratios.values())
    colocated = result.config["configurations"]["colocated"]
    assert colocated["engines"]["engine-c0"]["device_blocks"] == 4096
    assert [r["engine-c0"] for r in colocated["step_time_ratio"]["calibrated"]] == \
        pytest.approx([1.0, 1.1, 1.2, 1.3])
    assert Path(result.plots[0]).stat().st_size > 0
    save(result, tmp_path / "sim.json")  # JSON all the way down (no numpy scalars)


@BENCH_TIMEOUT
def test_sim_bench_measures_a_real_engine_and_writes_the_contract(tmp_path: Path):
    # The contract on the tiny preset: the default's (the real model's) quick run takes 5-7 minutes,
    # too long for the suite; the same code measures, calibrates and replays both.
    result, _ = quick_bench(tmp_path, "sim", 600, "--model", "tiny")
    assert result["config"]["model"] == "tiny"
    assert {f"sim_error_p90_e2e_{c}_{rate:g}" for rate in bench_sim.TINY.rates for c in ("colocated", "1p1d")} <= \
        result["targets"].keys()
    for configuration in result["config"]["configurations"].values():
        assert all(engine["device_blocks"] > 0 for engine in configuration["engines"].values())
        assert all(steps > 0 for steps in configuration["calibration"]["steps"].values())
    assert {row["compared"] for row in result["rows"]} >= {"measured", "simulated", "relative error"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0


def test_on_the_real_model_both_configurations_serve_it_at_rates_of_its_own():
    real = bench_sim.MODELS[DEFAULT_MODEL]
    for configuration, served in zip(bench_sim.CONFIGURATIONS, real.configurations()):
        assert served.setup.env["KVMESH_ENGINE_MODEL"] == DEFAULT_MODEL
        assert (served.key, served.topology, served.setup.up_args) == \
            (configuration.key, configuration.topology, configuration.setup.up_args)
    assert min(real.rates) < real.calibration_rate < max(real.rates)
    assert real.quick.min_requests >= 20 and real.full.min_requests >= real.quick.min_requests  # P90 not one request
    assert real.in_process is None
    assert bench_sim.MODELS["tiny"].configurations()[0].setup.env["KVMESH_ENGINE_MODEL"] == "tiny"


def test_the_simulated_engines_have_the_real_models_layers():
    engines = sim_engines("pd:1:1", dict.fromkeys(("engine-p0", "engine-d0"), STATE), DEFAULT_MODEL)
    assert {e: spec.num_layers for e, (_, spec, _) in engines.items()} == {"engine-p0": 30, "engine-d0": 30}


def test_without_an_in_process_profile_the_real_models_result_has_no_in_process_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real = bench_sim.MODELS[DEFAULT_MODEL]
    replayed = []
    for configuration in real.configurations():
        run = measured(configuration, real.rates)
        calibration = bench_sim.calibrated(run, DEFAULT_MODEL)
        replayed.append((run, calibration, bench_sim.variations(calibration, run, DEFAULT_MODEL, None)))
    assert "_in_process" not in [v.suffix for v in replayed[0][2]]
    result = bench_sim._result(True, real, real.quick, replayed, None)
    assert {f"sim_error_{n}_{c}_{r:g}" for n in bench_sim.TARGETED for c in ("colocated", "1p1d")
            for r in real.rates} == result.targets.keys()
    assert not any(k.endswith("_in_process") for k in result.ratios)
    assert result.config["model"] == DEFAULT_MODEL
    assert Path(result.plots[0]).name == f"sim_validation_{DEFAULT_MODEL}.png"
    save(result, tmp_path / "sim.json")


@pytest.mark.parametrize("model", list(bench_sim.MODELS))
def test_no_two_loads_send_the_same_requests(model):
    # serve.measured_load draws every load's requests from one seed: two loads of one count would send the
    # same prompts, and the engine's prefix cache would answer the second from the first
    on = bench_sim.MODELS[model]
    for plan in (on.quick, on.full):
        counts = [max(plan.min_requests, round(rate * plan.window_s)) for rate in on.rates]
        assert len(set(counts)) == len(counts)
