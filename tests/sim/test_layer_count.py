"""LayerKV in the simulator (issue 31): the native Scheduler over a real BlockManager with layer-wise
offloading and the SimEngine over its layer count make the same decisions step by step, the layers
each chunk stages included; and a step's staged layers cost what sim/staging_time.py's model says,
in closed form."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.offload import OffloadParams
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.staging_time import staged_step_s

from .test_one_scheduler import COST, SPEC, run_both

# Eq. 3 and 4's fits, made up so that Eq. 4 keeps x of 4 layers with L - x <= 1 + seqlen / 10: 3 of a
# 5-token prompt, 2 of 14, 1 of 20 (prefill seqlen (1 ms + 0.1 ms seqlen), offload 1 ms a token and layer).
PREFILL = PrefillCost(alpha=1.0, num_params=500, hidden_size=50, flops_per_s=1e6)
OFFLOAD = OffloadCost(beta=1.0, num_layers=4, head_dim=2, num_kv_heads=1, bytes_per_element=4,
                      bandwidth_bytes_per_s=16e3)
LAYERED = replace(SPEC, num_layers=4, device_blocks=56, cxl_blocks=96, staging_cap=8,
                  offload=OffloadParams(threshold_blocks=4, horizon_stages=2), prefill_cost=PREFILL,
                  offload_cost=OFFLOAD)


@pytest.mark.parametrize("admission", ["fcfs", "layerkv"])
@pytest.mark.parametrize("decode", [False, True], ids=["colocated", "decode"])
def test_the_simulator_offloads_layers_as_the_native_scheduler_step_by_step(admission, decode):
    policies = {"layer_offload": "layerkv", "prefill_admission": admission}
    native_log, sim_log, blocks, engine = run_both(policies, decode, LAYERED)

    for k, (ours, theirs) in enumerate(zip(sim_log, native_log)):
        assert ours == theirs, f"step {k}"
    staged = {layers for chunks, _, _ in sim_log for _, _, layers in chunks}
    assert len(staged) > 1, "the script is meant to offload some layers"
    assert blocks.free("device") == engine.free == LAYERED.device_blocks
    assert blocks.free("cxl") == engine.blocks.free("cxl") == LAYERED.cxl_blocks
    assert engine.scheduler.layers_offloaded["admitted"] > 0 and engine.scheduler.layers_offloaded["restored"] > 0


def test_a_tight_pool_does_not_livelock_layerkv():
    """40 device blocks instead of 56: a running request that found no staging room is staged before
    the next admissions take the room (they used to, each step, and the run never ended)."""
    run_both({"layer_offload": "layerkv"}, False, replace(LAYERED, device_blocks=40))


def test_a_request_is_counted_layer_by_layer_in_its_tiers():
    engine = SimEngine(LAYERED, COST, {"layer_offload": "layerkv"})
    blocks, request = engine.blocks, SimRequest("a", 0.0, 14, 9)
    assert blocks.place(request, (1, 3)) and request.offloaded == (0, 2) and request.device_layers == 2
    assert blocks.reserve(request, 4, 14)
    assert (blocks.free("device"), blocks.free("cxl")) == (56 - 8, 96 - 8)
    assert not blocks.place(request, (0, 1, 2, 3))  # it holds blocks: placed once, before them
    assert blocks.move_layers(request, [0], "device") and request.offloaded == (2,)
    assert (blocks.free("device"), blocks.free("cxl"), blocks.moved["device"]) == (56 - 12, 96 - 4, 4)
    assert blocks.swap_out(request) and request.tier == "cxl" and request.device_layers == 0
    blocks.release(request)
    assert (blocks.free("device"), blocks.free("cxl")) == (56, 96)
    assert request.layers == () and request.offloaded == () and request.view().device_layers is None
    lent = blocks.lend(6)
    assert len(lent) == 6 and blocks.free("device") == 50
    blocks.give_back()
    assert blocks.free("device") == 56


def test_layer_offload_needs_a_staging_area():
    with pytest.raises(ValueError, match="staging"):
        SimEngine(SPEC, COST, {"layer_offload": "layerkv"})
    with pytest.raises(ValueError, match="cxl tier"):
        EngineSpec(staging_cap=4)


T, L = 4.0, 4


def test_a_step_with_no_staged_layer_costs_its_compute():
    assert staged_step_s(T, L, {}) == T


def test_copies_that_hide_under_the_layers_leave_the_first_load_and_the_last_write():
    load, write = 0.3, 0.2  # l + w <= t = 1
    assert staged_step_s(T, L, {i: (load, write) for i in range(L)}) == pytest.approx(T + load + write)


def test_copy_bound_steps_last_every_copy_one_after_another():
    load, write = 1.0, 2.0  # t = 0.25 <= l, w
    assert staged_step_s(1.0, L, {i: (load, write) for i in range(L)}) == pytest.approx(L * (load + write))


def test_a_resident_last_layer_hides_the_last_write():
    # Interleaved (LayerKV 3.1.2): layers 1 and 3 resident, 0 and 2 staged; w <= t: only the first load shows.
    load, write = 0.3, 0.2
    assert staged_step_s(T, L, {0: (load, write), 2: (load, write)}) == pytest.approx(T + load)
    # A write longer than the layer after it shows by what it exceeds that layer: T + l + (w - t).
    assert staged_step_s(T, L, {0: (load, write), 2: (load, 1.5)}) == pytest.approx(T + load + 0.5)


def test_a_step_costs_its_staged_layers_copies_at_the_tiers_bandwidths():
    """A prefill chunk of a request with 3 layers offloaded writes its blocks back, loading nothing; its
    next chunk loads the first chunk's context in each of them and writes its own blocks. (No
    layer_offload policy: nothing restores the layers between the steps.)"""
    spec = replace(LAYERED, block_bytes=1000, swap_in_bytes_per_s=1e4, swap_out_bytes_per_s=2e4, token_budget=8)
    engine = SimEngine(spec, COST)
    request = SimRequest("a", 0.0, 14, 2)
    assert engine.blocks.place(request, (3,))
    engine.add(request)
    first = engine.schedule(0.0)
    assert first.chunks == [(request, 8)] and first.staged == {i: (0.0, 2 * 1000 / 2e4) for i in (0, 1, 2)}
    engine.complete(first, 1.0)
    second = engine.schedule(1.0)
    # 6 tokens more: blocks 2 and 3 written (block 2 fresh), blocks 0 and 1 of context loaded.
    assert second.staged == {i: (2 * 1000 / 1e4, 2 * 1000 / 2e4) for i in (0, 1, 2)}
    compute = COST.seconds(second.prefill_tokens, second.decode_tokens, second.decode_context, second.prefill_context)
    assert engine.seconds(second) == pytest.approx(staged_step_s(compute, 4, second.staged))
    # A cost with a term for the staged bytes (a CPU's inline copies): 3 layers x 4 blocks x 1000 bytes
    priced = SimEngine(spec, replace(COST, g=1e-6))
    assert priced.seconds(second) == pytest.approx(staged_step_s(compute + 1e-6 * 12_000, 4, second.staged))
