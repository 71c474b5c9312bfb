"""`kvmesh plan` with LayerKV's layer offload and Algorithm 1 as a search dimension: the engine spec it
runs, derived from the step-cost profile (Eq. 3), the KV geometry and cxl tier (Eq. 4) and kvmesh's
defaults (the staging area, Eq. 5); where it is searched; and a memory-bound workload it serves better."""

import json

import pytest

from kvmesh.cli import main
from kvmesh.policies.costs import OffloadCost
from kvmesh.policies.offload import OffloadParams
from kvmesh.policies.prefill_admission.layerkv import prefill_time_s
from kvmesh.policies.step_shape import chunk_shape
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.link import KVGeometry
from kvmesh.sim.plan_layers import layerkv_spec, prefill_fit
from kvmesh.sim.plan_search import layer_offload_choices, search_space
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology

GEOMETRY = KVGeometry(num_layers=4, kv_heads=2, head_dim=64, dtype_bytes=2)
TIERED = EngineSpec(num_layers=4, device_blocks=2000, cxl_blocks=8000, block_bytes=8192, swap_out_bytes_per_s=20e9)
HOOKS = {"kv_allocation": ["block_at_a_time"], "preemption_order": ["srtf"], "preemption_strategy": ["recompute"]}


def test_eq_3_is_read_off_a_step_cost_of_tokens_and_pairs():
    """b n + e n (n + 1) / 2 is Eq. 3's c1 n + c2 n^2 with c1 = b + e / 2 and c2 = e / 2 exactly."""
    cost = StepCost(a=0.0, b=1e-4, e=2e-7)
    fit = prefill_fit(cost)
    assert fit.alpha == 1.0 and fit.flops_per_s == 1e18
    assert fit.num_params == pytest.approx((1e-4 + 1e-7) * 1e18 / 2, rel=1e-9)
    assert fit.hidden_size == pytest.approx(1e-7 * 1e18 / 2, rel=1e-9)
    for n in (100, 1000, 10000):
        assert prefill_time_s(n, fit) == pytest.approx(cost.seconds(*chunk_shape(n, 0, n)), rel=1e-9)


def test_a_step_cost_whose_pairs_cost_nothing_fits_eq_3_by_its_tokens_alone():
    fit = prefill_fit(StepCost(a=0.05, b=1e-4))  # the fixed cost would bend c2 below 0
    assert fit.hidden_size == 0 and fit.num_params > 1e-4 * 1e18 / 2


def test_the_layerkv_engine_has_kvmeshs_staging_area_and_eq_5_and_the_tiers_eq_4():
    spec = layerkv_spec(TIERED, StepCost(a=0.0, b=1e-4), GEOMETRY)
    assert spec.staging_cap == 500 and spec.offload == OffloadParams(threshold_blocks=200, horizon_stages=8)
    assert spec.offload_cost == OffloadCost(beta=1.0, num_layers=4, head_dim=64, num_kv_heads=2,
                                            bytes_per_element=2, bandwidth_bytes_per_s=20e9)
    assert spec.prefill_cost == prefill_fit(StepCost(a=0.0, b=1e-4)) and spec.layered


def test_layerkv_is_searched_only_where_the_engines_can_run_it():
    assert layer_offload_choices(["none", "layerkv"], TIERED, GEOMETRY) == [False, True]
    assert layer_offload_choices(["none", "layerkv"], EngineSpec(num_layers=4), GEOMETRY) == [False]  # no tier
    one_layer = EngineSpec(cxl_blocks=64, block_bytes=8192)  # a block holds every layer: none to offload apart
    assert layer_offload_choices(["none", "layerkv"], one_layer, GEOMETRY) == [False]
    with pytest.raises(ValueError, match="--num-layers equal to --kv-geometry's 4 layers"):
        layer_offload_choices(["layerkv"], one_layer, GEOMETRY)
    space = search_space([2], ["colocated", "pd"], ["least_loaded"], ["pull", "push"], HOOKS, ["none", "lru"],
                         layer_offloads=[False, True])
    layered = [str(c).replace(" block_at_a_time srtf recompute", "") for c in space if c.layerkv]
    assert layered == ["colocated:2 least_loaded layerkv cache:none", "pd:1:1 least_loaded pull layerkv cache:none",
                       "pd:1:1 least_loaded push layerkv cache:none"]
    assert {c.cache for c in space if c.topology == Topology(prefill=1, decode=1)} == {"none", "lru"}


def test_plan_picks_layerkv_where_the_device_holds_few_long_prompts(tmp_path):
    """Prompts of 1-3K tokens in 8K tokens of KV a layer: with every layer on the device two or three
    run at once, and a preempted one recomputes its long prompt; LayerKV offloads layers and lets them
    in. (Preempted by a swap to the tier instead, FCFS comes within 3%: docs/sim.md, Planner.)"""
    out = tmp_path / "plan.json"
    assert main(["plan", "--rate", "1", "--requests", "100", "--prompt", "uniform:1024-3072", "--output", "exp:128",
                 "--slo", "ttft=3s", "--slo", "tpot=200ms", "--engines", "1", "--topologies", "colocated",
                 "--routing", "round_robin", "--kv-allocations", "block_at_a_time", "--preemption-orders",
                 "latest_arrival_first", "--preemption-strategies", "recompute", "--front-doors", "off",
                 "--device-blocks", "2048", "--num-layers", "4", "--cxl-blocks", "65536", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert body["config"]["search"]["layerkv"] == [False, True]
    found = {r["layerkv"]: r["goodput_rps"] for r in body["results"]}
    assert body["pick"]["winner"]["layerkv"] and found[True] > 1.5 * found[False]
