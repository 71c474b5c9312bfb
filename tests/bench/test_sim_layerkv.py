"""`kvmesh bench sim_layerkv`: the simulated engine is the method's engine, LayerKV's staging area,
Eq. 5's parameters, its decodes' mode and fits included; a replayed request carries its predicted
range; a run's name in keys; and, end to end, `--quick --json` measures bench layerkv's runs and
replays them (in the default mode, restore; bench layerkv's test runs stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.bench import layerkv
from kvmesh.bench import sim_layerkv as bench
from kvmesh.bench.cacheopt_serving import RunStats, Served
from kvmesh.bench.layerkv_traces import fixed
from kvmesh.bench.sim_replay import InlineCopies, sim_requests
from kvmesh.libs.messages.engine import Targets
from kvmesh.sim.engine import EngineSpec, SimEngine, Step
from kvmesh.sim.step_cost import StepCost

from .quick import BENCH_TIMEOUT, quick_bench


def test_the_simulated_engine_offloads_layers_as_the_methods_engine_does():
    torch.set_num_threads(1)
    profile: list = []
    ours, fcfs = bench.configured_engine("layerkv", "stage", profile), bench.configured_engine("fcfs", "stage", profile)
    assert ours.policies["layer_offload"] == "layerkv" and ours.policies["prefill_admission"] == "layerkv"
    assert ours.spec.offload.decode_offloaded == "stage"
    assert ours.spec.staging_cap > 0 and ours.spec.cxl_blocks > 0 and ours.spec.offload.threshold_blocks > 0
    assert ours.spec.prefill_cost == profile[0].prefill_cost and ours.spec.offload_cost == profile[0].offload_cost
    # Its layer copies run at the bandwidth its profile measured (Eq. 4's).
    assert ours.spec.swap_out_bytes_per_s == profile[0].offload_cost.bandwidth_bytes_per_s
    # FCFS keeps every layer: the simulator counts its blocks whole.
    assert fcfs.spec.staging_cap == 0 and fcfs.spec.prefill_cost is None and not fcfs.spec.layered
    assert fcfs.spec.device_blocks == ours.spec.device_blocks and fcfs.spec.num_layers == 8


def test_a_replayed_request_carries_its_predicted_range():
    requests = fixed(2, 64, seed=1)
    told = [Targets(ttft_slo_ms=900.0, tbt_slo_ms=60.0, predicted_output_len=100 + i, predicted_output_low=80 + i,
                    predicted_output_median=90 + i) for i in range(2)]
    stats = RunStats([Served(0.0, [0.1], 0)] * 2, {}, 1.0, [0.0, 0.5], told, [])
    views = [r.view() for r in sim_requests(stats, requests, 128)]
    assert [(v.predicted_output_low, v.predicted_output_median, v.max_tokens) for v in views] == \
        [(80, 90, 128), (81, 91, 128)]


def test_inline_copies_add_to_the_step_instead_of_overlapping_it():
    spec = EngineSpec(num_layers=4, device_blocks=512, cxl_blocks=1024, block_bytes=1024, staging_cap=64)
    cost = StepCost(a=0.04, b=0.0, c=0.0, d=0.0, e=0.0)  # 10 ms a layer
    step = Step(staged={0: (0.002, 0.001), 2: (0.002, 0.001)})
    assert SimEngine(spec, cost).seconds(step) < 0.04 + 0.006  # the copies hide behind the compute but the ends
    assert InlineCopies(spec, cost).seconds(step) == pytest.approx(0.04 + 0.006)


def test_a_runs_name_in_keys():
    assert [bench.run_name(m, n) for m, n in (("layerkv-noslo", "A 1536"), ("fcfs", "B 3x"))] == \
        ["layerkv_noslo_a1536", "fcfs_b3x"]


@BENCH_TIMEOUT
def test_sim_layerkv_bench_replays_bench_layerkvs_runs_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "sim_layerkv", timeout=600)
    runs = {bench.run_name(m, n) for m in layerkv.METHODS for n in (f"A {layerkv.LONGEST}", "B 3x")}
    targeted = {k for k in result["targets"] if k.startswith("sim_error_p90_e2e")}
    assert {f"sim_error_p90_e2e_{r}" for r in runs} == targeted
    assert result["config"]["calibration"]["steps"] > 0
    assert result["config"]["engines"]["layerkv"]["staging_cap"] > 0
    assert result["config"]["layer_decode"] == result["config"]["engines"]["layerkv"]["offload"]["decode_offloaded"] \
        == "restore"
    assert {row["compared"] for row in result["rows"]} >= {"measured", "simulated", "relative error"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
