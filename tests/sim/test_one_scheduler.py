"""One iteration scheduler (issue 31): the native engine's Scheduler over its real BlockManager, and
the simulator's SimEngine over its count of blocks, given the same requests at the same times, make
the same decisions step by step: the chunks, who is admitted, who is preempted and how."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.policies.allocation import AllocationParams
from kvmesh.policies.iteration.reuse import Reuse, WindowParams
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
                        spec.num_layers,
                        targets=Targets(ttft_slo_ms=ttft, tbt_slo_ms=tbt, predicted_output_len=predicted),
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
    """A swap takes its direction's fixed cost plus block_bytes over its bandwidth for each block it
    copies, on top of the step cost: b's 4 blocks in each of 2 layers, 64 bytes each, out at 1 MB/s
    (0.512 ms) after 0.25 s, back in at 2 MB/s (0.256 ms) after 0.5 s."""
    spec = replace(SPEC, swap_out_fixed_s=0.25, swap_in_fixed_s=0.5)
    engine = SimEngine(spec, COST, {"preemption_strategy": "swap"}, SMALL)
    a, b = SimRequest("a", 0.0, 12, 20), SimRequest("b", 0.0, 8, 20)  # 8 and 7 blocks a layer at their longest
    engine.add(a)
    engine.add(b)
    for k in range(40):
        step = engine.schedule(float(k))
        if step.preempted:
            break
        engine.complete(step, k + 0.5)
    assert step.preempted == [("b", "swap")]
    assert b.tier == "cxl" and SPEC.num_layers * b.blocks_per_layer * SHAPE.bytes == 2 * 4 * 64
    assert step.swap_s == pytest.approx(0.25 + 0.512e-3, rel=1e-12)
    assert engine.seconds(step) == pytest.approx(COST.seconds(step.prefill_tokens, step.decode_tokens,
                                                             step.decode_context, step.prefill_context) + step.swap_s)
    while b.tier == "cxl":  # a runs on until b fits again, and is swapped back in
        engine.complete(step, k + 0.5)
        k += 1
        step = engine.schedule(float(k))
    assert step.swap_s == pytest.approx(0.5 + 0.256e-3, rel=1e-12)


# With the prefix cache: three conversations that open with the same 8-token system prompt, each turn's
# prompt the previous turn's prompt and answer (the runner samples token 0) and 3 to 6 new tokens; the
# longest, 36 tokens, fits the pool.
# (conversation, turn, arrival, new tokens, output)
TURNS = [(0, 0, 0.0, 6, 4), (1, 0, 0.5, 3, 6), (2, 0, 1.0, 5, 4), (0, 1, 6.0, 4, 4), (1, 1, 7.0, 5, 3),
         (2, 1, 8.0, 3, 5), (0, 2, 13.0, 3, 3), (1, 2, 14.0, 4, 3), (2, 2, 15.0, 4, 3), (1, 3, 20.0, 3, 2)]
SYSTEM = list(range(1, 9))


def conversations() -> list[tuple[str, float, list[int], int]]:
    """(request id, arrival, prompt tokens, output length) of every turn of TURNS."""
    history, script = {}, []
    for conversation, turn, arrival, new, out in TURNS:
        prompt = history.get(conversation, SYSTEM) + [1000 * (conversation + 1) + 10 * turn + i for i in range(new)]
        script.append((f"c{conversation}t{turn}", arrival, prompt, out))
        history[conversation] = prompt + [0] * out
    return script


def run_cached(policies: dict[str, str], cache_cxl: bool) -> tuple[list, list, BlockManager, SimEngine]:
    """run_both's, with the prefix cache on both sides (and CaR's cxl tier of nodes, window and prefetch
    when `cache_cxl`); the native engine's step (engine.py) around the model: its reloads, commits and
    the offload past the high-water mark."""
    hooks = Policies(policies)
    pools = {"device": KVPool("device", SPEC.device_blocks, SHAPE), "cxl": KVPool("cxl", SPEC.cxl_blocks, SHAPE)}
    blocks = BlockManager(pools, LAYERS, hooks, cache_cxl=cache_cxl)
    blocks.layerwise_reload = cache_cxl  # as the factory sets it
    window = WindowParams(size=2, max_wait_s=3.0)
    scheduler = Scheduler(blocks, hooks, SPEC.max_num_seqs, SPEC.token_budget, SMALL,
                          reuse=Reuse(blocks, window, SPEC.swap_in_bytes_per_s))
    spec = replace(SPEC, prefix_caching=True, cache_cxl=cache_cxl, window=window)
    engine = SimEngine(spec, COST, policies, SMALL)
    script = conversations()
    natives = [Request(rid, prompt, SamplingParams(max_tokens=out), arrival, LAYERS)
               for rid, arrival, prompt, out in script]
    sims = [SimRequest(rid, arrival, len(prompt), out, block_names=tuple(node_ids(prompt + [0] * out, BLOCK)))
            for rid, arrival, prompt, out in script]
    native_log, sim_log = [], []
    for k in range(400):
        now = float(k)
        for n, s in zip(natives, sims):
            if n.arrival <= now < n.arrival + 1.0:
                scheduler.add(n)
                engine.add(s)
        step = engine.schedule(now)
        sim_log.append(([(r.request_id, n) for r, n in step.chunks], step.preempted, [r.num_cached for r in sims]))
        if step.chunks:
            engine.complete(step, now + engine.seconds(step))
        plan = scheduler.schedule(now)
        native_log.append(([(c.request.request_id, c.num_tokens) for c in plan.chunks],
                           [(r.request_id, how) for r, how in plan.preempted], [r.num_cached for r in natives]))
        if not plan.chunks:
            blocks.flush_loads()
            continue
        done = now + engine.seconds(step)
        blocks.loads_done()
        scheduler.iteration_s.append(done - now)
        sampling = [c.request for c in plan.chunks if c.samples]
        for chunk in plan.chunks:
            chunk.request.num_computed += chunk.num_tokens
            blocks.commit(chunk.request, done)
        for request in sampling:
            request.output_ids.append(0)
            request.output_times.append(done)
            if len(request.output_ids) >= request.sampling.max_tokens:
                scheduler.finish(request, "length")
        blocks.offload_idle()
        if k > 25 and not (scheduler.has_work() or engine.has_work()):
            break
    assert all(r.finished for r in natives) and all(r.finished_at is not None for r in sims)
    return native_log, sim_log, blocks, engine


@pytest.mark.parametrize("policies, cache_cxl", [
    ({}, False),
    ({"preemption_strategy": "swap"}, False),
    ({"prefill_admission": "car", "cache_policy": "car"}, True),
    ({"prefill_admission": "car", "cache_policy": "car", "preemption_strategy": "swap"}, True),
    ({"cache_policy": "lru"}, True),
], ids=["lru", "lru+swap", "car", "car+swap", "lru+cxl"])
def test_the_simulator_counts_the_prefix_cache_as_the_native_block_manager(policies, cache_cxl):
    native_log, sim_log, blocks, engine = run_cached(policies, cache_cxl)

    for k, (ours, theirs) in enumerate(zip(sim_log, native_log)):
        assert ours == theirs, f"step {k}"
    assert sum(r for r in sim_log[-1][2]) > 0, "the script is meant to reuse cached prefixes"
    ours = engine.blocks
    assert (ours.hit_tokens, dict(ours.hit_blocks), dict(ours.moved_nodes)) == \
        (blocks.hit_tokens, dict(blocks.hit_blocks), dict(blocks.moved_nodes))
    assert {t: sum(n.tier == t for n in ours.cached.values()) for t in ("device", "cxl")} == \
        {t: sum(n.tier == t for n in blocks.cached.values()) for t in ("device", "cxl")}
    assert set(ours.cached) == set(blocks.cached)
    assert blocks.free("device") == engine.free == SPEC.device_blocks
    if cache_cxl:
        assert ours.moved_nodes["cxl"] > 0, "the script is meant to move nodes to the cxl tier"
