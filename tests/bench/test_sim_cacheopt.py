"""`kvmesh bench sim_cacheopt`: a run's requests are replayed as it gave them (arrivals, lengths, SLOs,
estimated lengths, the max_tokens the policies read); the simulated engine is the method's engine;
every request runs to its trace length; the result has every method's and rate's keys and keeps the
contract; and, end to end, `--quick --json` measures bench cacheopt's runs and replays them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvmesh.bench import cacheopt
from kvmesh.bench import sim_cacheopt as bench
from kvmesh.bench import sim_replay
from kvmesh.bench.cacheopt_serving import RunStats, Served
from kvmesh.bench.loadgen import poisson_arrivals
from kvmesh.bench.report import BenchResult, save
from kvmesh.bench.sim_validation import FIGURES, TARGETED
from kvmesh.libs.messages.engine import Targets
from kvmesh.policies.allocation import AllocationParams
from kvmesh.policies.step_shape import FIELDS
from kvmesh.sim.engine import HOOKS, EngineSpec
from kvmesh.sim.fit import fit_engine_steps
from kvmesh.sim.step_cost import StepCost, load_profile

from .quick import BENCH_TIMEOUT, quick_bench

TRACE = cacheopt.TRACES["instructions"]
REQUESTS = TRACE.requests(12, seed=1)
HIGH = TRACE.output.high
TRUTH = StepCost(a=2e-3, b=5e-5, c=8e-5, d=3e-7, e=1e-7)  # five terms, as the benches calibrate (f held at 0)
ENGINE = sim_replay.Configured(EngineSpec(block_size=16, num_layers=4, device_blocks=4096, token_budget=2048),
                          {"kv_allocation": "block_at_a_time"}, AllocationParams(reserved_blocks=0))


def recorded_steps(count: int, factor: float = 1.0, seed: int = 0) -> list[dict]:
    """Steps as the replay records them, each taking `factor` times what TRUTH says of its shape."""
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(count):
        shape = (int(rng.integers(0, 512)), int(rng.integers(0, 16)), int(rng.integers(0, 20_000)),
                 int(rng.integers(0, 100_000)), int(rng.integers(0, 8)))
        steps.append({"index": i + 1, "end": float(i), "seconds": factor * TRUTH.seconds(*shape),
                      **dict(zip(FIELDS, shape))})
    return steps


def fake_run(rate: float, factor: float = 1.0, targets: list[Targets] | None = None) -> RunStats:
    """What bench cacheopt's replay would have recorded at `rate`, with made-up token times."""
    arrivals = poisson_arrivals(len(REQUESTS), rate, seed=2)
    served = [Served(float(a), [float(a) + 0.02 + 0.005 * k for k in range(r.output_len)], 0)
              for r, a in zip(REQUESTS, arrivals)]
    targets = targets or [Targets(ttft_slo_ms=100.0 + i, tbt_slo_ms=20.0, predicted_output_len=40 + i)
                          for i in range(len(REQUESTS))]
    return RunStats(served, {"recompute": 0, "swap": 0}, 1.0, arrivals.tolist(), targets,
                    recorded_steps(40, factor, seed=int(rate)))


def test_a_replayed_request_is_the_runs_request_as_it_was_given():
    run = fake_run(8)
    replayed = sim_replay.sim_requests(run, REQUESTS, HIGH)
    assert [(r.request_id, r.arrival, r.prompt_len, r.max_tokens) for r in replayed] == \
        [(f"r{i}", a, len(q.prompt_ids), q.output_len) for i, (q, a) in enumerate(zip(REQUESTS, run.arrivals))]
    assert [(r.ttft_slo_ms, r.tbt_slo_ms, r.predicted_output_len) for r in replayed] == \
        [(t.ttft_slo_ms, t.tbt_slo_ms, t.predicted_output_len) for t in run.targets]
    # It ends at its trace length, but its policies read the max_tokens it was sent with.
    assert {r.view().max_tokens for r in replayed} == {HIGH}


def test_every_request_runs_to_its_trace_length():
    simulated, info = sim_replay.simulated(fake_run(8), REQUESTS, HIGH, ENGINE, TRUTH)
    assert [len(s.times) for s in simulated.served] == [r.output_len for r in REQUESTS]
    assert info["unfinished"] == 0 and info["steps"] > 0


def test_the_simulated_engine_is_the_methods_engine():
    engine = cacheopt.method_engine(TRACE, cacheopt.MAIN[3])
    coopt = sim_replay.configured(engine)
    blocks = cacheopt.pool_blocks(TRACE, cacheopt.BLOCK_SIZE)
    assert (coopt.spec.device_blocks, coopt.spec.cxl_blocks, coopt.spec.block_size, coopt.spec.num_layers) == \
        (4 * blocks, 8 * blocks, cacheopt.BLOCK_SIZE, 4)
    assert coopt.spec.token_budget == 2048 and coopt.spec.max_num_seqs == 64
    assert {hook: coopt.policies[hook] for hook in cacheopt.COOPT} == cacheopt.COOPT
    assert set(coopt.policies) <= set(HOOKS)
    assert coopt.allocation.reserved_blocks == 1
    # Its swaps copy at the rate its own swap profile measured (the simulator's default where the
    # profile's fit found no positive slope, as it can on a loaded machine).
    rates = sim_replay.copy_rates(engine) or {"swap_out_bytes_per_s": EngineSpec().swap_out_bytes_per_s,
                                              "swap_in_bytes_per_s": EngineSpec().swap_in_bytes_per_s}
    assert coopt.spec.block_bytes > 0
    assert (coopt.spec.swap_out_bytes_per_s, coopt.spec.swap_in_bytes_per_s) == \
        (rates["swap_out_bytes_per_s"], rates["swap_in_bytes_per_s"])


def measured() -> bench.Measured:
    """A made-up sweep of the quick shape: each run's steps slower than the calibration's by its index."""
    rates = [10.0 * f for f in bench.QUICK.fractions]
    runs = {(m.name, rate): fake_run(rate, 1 + 0.1 * i)
            for i, (m, rate) in enumerate((m, r) for m in bench.QUICK.methods for r in rates)}
    slos = cacheopt.Slos(TRACE, REQUESTS)
    return bench.Measured(TRACE, REQUESTS, 10.0, rates, fake_run(9), runs,
                          dict.fromkeys((m.name for m in bench.QUICK.methods), ENGINE), slos)


def test_the_result_has_every_methods_and_rates_keys_and_keeps_the_contract(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = measured()
    calibrated, fit = fit_engine_steps(run.calibration.steps)
    assert calibrated.a == pytest.approx(TRUTH.a, rel=1e-6)
    others = [("_in_process", "in-process steps", load_profile(bench.PROFILE))]
    replays = [bench.Replayed(m, bench.QUICK.fractions[run.rates.index(rate)], stats,
                              sim_replay.variations(stats, REQUESTS, HIGH, ENGINE, calibrated, others))
               for (m, rate), stats in run.runs.items()]
    result = bench._result(True, bench.QUICK, run, replays, calibrated, fit)
    assert isinstance(result, BenchResult)
    for method in ("block", "rlp", "s3", "cacheopt"):
        for fraction in bench.QUICK.fractions:
            for name in FIGURES:
                key = f"sim_error_{name}_{method}_{fraction:g}"
                assert {key, f"{key}_rescaled", f"{key}_own_steps", f"{key}_in_process",
                        f"sim_elasticity_{name}_{method}_{fraction:g}"} <= result.ratios.keys()
                assert (key in result.targets) is (name in TARGETED)
    assert set(result.directions.values()) == {"<="}
    assert all(not math.isnan(v) for v in result.ratios.values())
    runs = result.config["runs"].values()
    assert [r["step_time_ratio_calibrated"] for r in runs] == pytest.approx([1 + 0.1 * i for i in range(len(runs))])
    # Each run's steps are the calibration's cost times a factor: rescaled to the run, it is the run's own.
    for r in runs:
        assert r["variations"]["_rescaled"]["step_cost"] == pytest.approx(r["variations"]["_own_steps"]["step_cost"])
    assert Path(result.plots[0]).stat().st_size > 0
    save(result, tmp_path / "sim_cacheopt.json")  # JSON all the way down (no numpy scalars)


def test_ablation_names_in_keys():
    assert [bench.key_name(m.name) for m in cacheopt.ABLATIONS] == \
        ["no_cka", "no_rsa", "no_pa", "no_gr", "no_pp", "no_pss", "with_vg"]


@BENCH_TIMEOUT
def test_sim_cacheopt_bench_replays_bench_cacheopts_runs_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "sim_cacheopt", timeout=600)
    assert {f"sim_error_p90_e2e_{m}_{f:g}" for m in ("block", "rlp", "s3", "cacheopt")
            for f in bench.QUICK.fractions} == {k for k in result["targets"] if k.startswith("sim_error_p90_e2e")}
    assert result["config"]["calibration"]["steps"] > 0
    assert all(run["measured_steps"] > 0 for run in result["config"]["runs"].values())
    assert {row["compared"] for row in result["rows"]} >= {"measured", "simulated", "relative error"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
