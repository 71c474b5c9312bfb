"""One iteration scheduler (issue 31): the native engine's Scheduler over its real BlockManager, and
the simulator's SimEngine over its count of blocks, given the same requests at the same times, make
the same decisions step by step: the chunks, who is admitted, who is preempted and how."""

from __future__ import annotations

import pytest
import torch

from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.policies.allocation import AllocationParams
from kvmesh.services.engine.kv_blocks import BlockShape
from kvmesh.services.engine.native.block_manager import BlockManager
from kvmesh.services.engine.native.kv_pool import KVPool
from kvmesh.policies.iteration import Policies
from kvmesh.services.engine.native.request import Request
from kvmesh.services.engine.native.scheduler import Scheduler
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

LAYERS, BLOCK = 2, 4
SHAPE = BlockShape(block_size=BLOCK, num_kv_heads=1, head_dim=2, dtype=torch.float32)
SPEC = EngineSpec(block_size=BLOCK, num_layers=LAYERS, device_blocks=20, max_num_seqs=4, token_budget=12,
                  cxl_blocks=16, block_bytes=SHAPE.bytes, swap_out_bytes_per_s=1e6, swap_in_bytes_per_s=2e6)
COST = StepCost(a=0.5, b=0.01, c=0.02)
# CacheOpt's knobs scaled to 4-token blocks and a 10-block-per-layer pool.
SMALL = AllocationParams(block_tokens=2, embed_buffer=2, reserved_blocks=2, no_slo_rt_s=5.0)
# (id, arrival, prompt, output, TTFT SLO ms, TBT SLO ms, predicted output): more than the pool holds.
SCRIPT = [("a", 0.0, 14, 9, None, 1500.0, 8), ("b", 0.0, 9, 12, 4000.0, None, 4),
          ("c", 1.0, 6, 7, None, 3000.0, None), ("d", 2.0, 11, 10, 2000.0, 1500.0, 12),
          ("e", 2.5, 5, 14, None, None, 6), ("f", 4.0, 13, 6, 8000.0, 4000.0, 3),
          ("g", 6.0, 7, 11, None, 1500.0, 11), ("h", 9.0, 10, 8, 3000.0, None, None)]


def native(policies: dict[str, str], decode: bool, spec: EngineSpec = SPEC) -> tuple[BlockManager, Scheduler,
                                                                                    list[Request]]:
    pools = {"device": KVPool("device", spec.device_blocks, SHAPE), "cxl": KVPool("cxl", spec.cxl_blocks, SHAPE)}
    hooks = Policies(policies)
    blocks = BlockManager(pools, spec.num_layers, hooks, prefix_caching=False)  # the simulator counts no prefix cache
    blocks.use_layer_costs(spec.prefill_cost, spec.offload_cost)  # LayerKV's fits, as profiled at start
    scheduler = Scheduler(blocks, hooks, spec.max_num_seqs, spec.token_budget, SMALL, spec.staging_cap, spec.offload)
    # decode: the prompt and its first token, the prompt's KV to come from a prefill engine (pushed into
    # blocks reserved for it, as a decode engine in push mode holds them).
    requests = [Request(rid, list(range(100 * i, 100 * i + prompt + decode)), SamplingParams(max_tokens=out), arrival,
                        spec.num_layers, targets=Targets(ttft_slo_ms=ttft, tbt_slo_ms=tbt, predicted_output_len=predicted),
                        reservation=decode)
                for i, (rid, arrival, prompt, out, ttft, tbt, predicted) in enumerate(SCRIPT)]
    return blocks, scheduler, requests


def native_step(scheduler: Scheduler, now: float, seconds) -> tuple:
    """What the engine does around the model (services/engine/native/engine.py's step), the model left out."""
    plan = scheduler.schedule(now)
    decisions = ([(c.request.request_id, c.num_tokens, tuple(c.request.offloaded)) for c in plan.chunks],
                 [(r.request_id, how) for r, how in plan.preempted], [r.request_id for r in plan.pulls])
    if plan.chunks:
        done = now + seconds(decisions)
        scheduler.iteration_s.append(done - now)
        scheduler.blocks.give_back([*plan.staging[0], *plan.staging[1]])
        sampling = [c.request for c in plan.chunks if c.samples]
        for chunk in plan.chunks:
            chunk.request.num_computed += chunk.num_tokens
        for request in sampling:
            request.output_ids.append(0)
            request.output_times.append(done)
            if len(request.output_ids) >= request.sampling.max_tokens:
                scheduler.finish(request, "length")
    return decisions


def run_both(policies: dict[str, str], decode: bool = False,
             spec: EngineSpec = SPEC) -> tuple[list, list, BlockManager, SimEngine]:
    """Both, step by step at the same times (each step lasting what the simulator says); each one's
    decisions a step: (chunks as (request id, tokens, layers staged), preempted as (request id,
    strategy), KV to pull). With `decode`, as a decode engine: each request's prompt KV arrives two
    steps after its blocks were given."""
    blocks, scheduler, natives = native(policies, decode, spec)
    engine = SimEngine(spec, COST, policies, SMALL)
    sims = [SimRequest(rid, arrival, prompt + decode, out, ttft, tbt, predicted, kv_elsewhere=prompt if decode else 0)
            for rid, arrival, prompt, out, ttft, tbt, predicted in SCRIPT]
    by_id = {n.request_id: (n, s) for n, s in zip(natives, sims)}
    durations: list[float] = []
    native_log, sim_log = [], []
    for k in range(400):
        now = float(k)
        for n, s in zip(natives, sims):
            if n.arrival <= now < n.arrival + 1.0:
                scheduler.add(n)
                engine.add(s)
        for request_id in sim_log[k - 2][2] if k >= 2 else []:
            n, s = by_id[request_id]
            scheduler.pulled(n, now)
            engine.pulled(s)
        step = engine.schedule(now)
        sim_log.append(([(r.request_id, n, r.offloaded) for r, n in step.chunks], step.preempted,
                        [r.request_id for r in step.pulls]))
        if step.chunks:
            durations.append(engine.seconds(step))
            engine.complete(step, now + durations[-1])
        native_log.append(native_step(scheduler, now, lambda _: durations[-1]))
        if k > 10 and not (scheduler.has_work() or scheduler.pulling or engine.has_work() or engine.pulling):
            break
    assert all(r.finished for r in natives) and all(r.finished_at is not None for r in sims)
    return native_log, sim_log, blocks, engine


@pytest.mark.parametrize("policies", [
    {},
    {"preemption_strategy": "swap"},
    {"kv_allocation": "cacheopt", "preemption_strategy": "swap"},
    {"kv_allocation": "cacheopt", "preemption_order": "cacheopt", "preemption_strategy": "swap"},
    {"kv_allocation": "estimate", "preemption_order": "srtf"},
], ids=["block_at_a_time", "block_at_a_time+swap", "cacheopt+swap", "cacheopt+cacheopt_order+swap", "estimate+srtf"])
@pytest.mark.parametrize("decode", [False, True], ids=["colocated", "decode"])
def test_the_simulator_decides_as_the_native_scheduler_step_by_step(policies, decode):
    native_log, sim_log, blocks, engine = run_both(policies, decode)

    for k, (ours, theirs) in enumerate(zip(sim_log, native_log)):
        assert ours == theirs, f"step {k}"
    preempted = [how for _, strategies, _ in sim_log for _, how in strategies]
    pulled = [request_id for _, _, pulls in sim_log for request_id in pulls]
    assert sorted(pulled) == (sorted(rid for rid, *_ in SCRIPT) if decode else [])
    assert preempted, "the script is meant to squeeze the pool"
    assert ("swap" in preempted) == (policies.get("preemption_strategy") == "swap")
    assert blocks.free("device") == engine.free == SPEC.device_blocks
    assert engine.blocks.free("cxl") == SPEC.cxl_blocks


def test_a_step_waits_for_its_swaps_copies():
    """Each block a swap copies takes block_bytes over its direction's bandwidth, on top of the step cost."""
    engine = SimEngine(SPEC, COST, {"preemption_strategy": "swap"}, SMALL)
    a, b = SimRequest("a", 0.0, 12, 20), SimRequest("b", 0.0, 8, 20)  # 8 and 7 blocks a layer at their longest
    engine.add(a)
    engine.add(b)
    for k in range(40):
        step = engine.schedule(float(k))
        if step.preempted:
            break
        engine.complete(step, k + 0.5)
    assert step.preempted == [("b", "swap")]
    swapped = SPEC.num_layers * b.blocks_per_layer
    assert b.tier == "cxl" and swapped > 0
    assert step.swap_s == pytest.approx(swapped * SHAPE.bytes / SPEC.swap_out_bytes_per_s)
    assert engine.seconds(step) == pytest.approx(COST.seconds(step.prefill_tokens, step.decode_tokens,
                                                             step.decode_context, step.prefill_context) + step.swap_s)
    while b.tier == "cxl":  # a runs on until b fits again, and is swapped back in
        engine.complete(step, k + 0.5)
        k += 1
        step = engine.schedule(float(k))
    assert step.swap_s == pytest.approx(swapped * SHAPE.bytes / SPEC.swap_in_bytes_per_s)
