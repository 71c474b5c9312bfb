"""`kvmesh bench sim_car`: a replayed request names its blocks by its tokens, so a conversation's next
turn extends its last one's names; the simulated engine has the engine's prefix cache, cxl tier and
window; the replay's clients are closed-loop as bench car's; and, end to end, `--quick --json`
measures bench car's runs and replays them."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from kvmesh.bench import car
from kvmesh.bench import sim_car as bench
from kvmesh.bench.car_workloads import ANSWER_LEN, conversations
from kvmesh.bench.sim_replay import configured
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.native.factory import build_engine
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

from .quick import BENCH_TIMEOUT, quick_bench


def test_a_conversations_next_turn_names_its_last_turns_blocks_first():
    torch.set_num_threads(1)
    outcome = car.serve_multi_turn(car.METHODS["lru"], conversations(1, 2, seed=1), lambda: None, model="tiny")
    run = bench.measured(outcome)
    first, second = run.block_names
    assert len(first) == (len(run.requests[0].prompt_ids) + ANSWER_LEN) // car.BLOCK_SIZE
    assert second[:len(first)] == first
    assert run.clients == [(1, [0, 1])]
    assert run.stats.arrivals[0] == 0.0 and run.stats.steps


def test_the_simulated_engine_has_the_engines_prefix_cache_cxl_tier_and_window():
    engine = build_engine(EngineConfig(model="tiny", device_blocks=256, cxl_blocks=512, prefix_cache_cxl=True,
                                       car_window=4, cache_high_water=0.8, swap_profile="off", layer_profile="off",
                                       policies={"cache_policy": "car", "prefill_admission": "car"}))
    spec = configured(engine).spec
    assert spec.prefix_caching and spec.cache_cxl and spec.cache_high_water == 0.8 and spec.window.size == 4
    # Its cxl tier copies at the rate the engine timed at start for its prefetcher.
    assert spec.swap_in_bytes_per_s == engine.scheduler.reuse.bandwidth > 0


def test_bench_cars_clients_from_its_request_ids():
    assert bench.clients(["c0-t0", "c1-t0", "c1-t1", "c0-t1"]) == [(1, [0, 3]), (1, [1, 2])]
    assert bench.clients([f"s{i}" for i in range(6)]) == [(car.CLIENTS, list(range(6)))]


def test_a_closed_loop_client_sends_its_next_request_when_it_has_the_last_answer():
    engine = SimEngine(EngineSpec(block_size=16, device_blocks=64), StepCost(a=0.01))
    first, second = (SimRequest(f"r{i}", 0.0, 16, 2) for i in range(2))
    bench.ClosedLoop({"e": ("both", engine)}, clients=[(1, [0, 1])]).run([first, second])
    # One step computes the prompt and samples the first token, the next the second: 10 ms each.
    assert first.token_times == pytest.approx([0.01, 0.02])
    assert second.arrival == pytest.approx(0.02) and second.token_times == pytest.approx([0.03, 0.04])


def test_a_closed_loop_of_two_clients_keeps_two_requests_in_flight():
    engine = SimEngine(EngineSpec(block_size=16, device_blocks=64), StepCost(a=0.01))
    requests = [SimRequest(f"r{i}", 0.0, 16, 2) for i in range(4)]
    partial(bench.ClosedLoop, clients=[(2, [0, 1, 2, 3])])({"e": ("both", engine)}).run(requests)
    # Both first requests in the first step, both next ones sent at the second's end, in the third.
    assert [r.arrival for r in requests] == pytest.approx([0.0, 0.0, 0.02, 0.02])
    assert [r.finished_at for r in requests] == pytest.approx([0.02, 0.02, 0.04, 0.04])


@BENCH_TIMEOUT
def test_sim_car_bench_replays_bench_cars_runs_and_writes_the_contract(tmp_path: Path):
    result, _ = quick_bench(tmp_path, "sim_car", timeout=600)
    runs = {bench.run_name(m, w) for m in car.METHODS for w in bench.WORKLOADS}
    targeted = {k for k in result["targets"] if k.startswith("sim_error_p90_e2e")}
    assert {f"sim_error_p90_e2e_{r}" for r in runs} == targeted
    assert result["config"]["calibration"]["steps"] > 0
    assert result["config"]["engines"]["car_prefetch_multi_turn"]["cache_cxl"]
    assert "sim_error_p90_ttft_car_multi_turn_copy_25gbps" in result["ratios"]
    assert {row["compared"] for row in result["rows"]} >= {"measured", "simulated", "relative error", "prefix cache"}
    assert Path(tmp_path / result["plots"][0]).stat().st_size > 0
