"""Block accounting of the scheduler and block manager, without a model: random add / step / abort
sequences (hypothesis state machine), under every allocation policy and with layers offloaded at
random (LayerKV), keep every reference count and every allocation exact, and everything comes back."""

from __future__ import annotations

import random
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.policies import registry
from kvmesh.policies.allocation import AllocationParams
from kvmesh.policies.cache import lru
from kvmesh.policies.offload.plan import OffloadInput, OffloadPlan
from kvmesh.services.engine.kv_blocks import BlockShape
from kvmesh.services.engine.native.block_manager import BlockManager
from kvmesh.services.engine.native.kv_pool import KVPool
from kvmesh.policies.iteration import Policies
from kvmesh.policies.iteration.reuse import Reuse, WindowParams
from kvmesh.services.engine.native.request import Request, Status
from kvmesh.services.engine.native.link_bandwidth import link_bandwidth
from kvmesh.services.engine.native.scheduler import Scheduler

LAYERS, BLOCK = 2, 4
SHAPE = BlockShape(block_size=BLOCK, num_kv_heads=1, head_dim=2, dtype=torch.float32)


ALLOCATIONS = ("block_at_a_time", "estimate", "s3", "cacheopt")
# CacheOpt's knobs scaled to these 4-token blocks and 12-block pools.
SMALL = AllocationParams(block_tokens=2, embed_buffer=2, reserved_blocks=2, no_slo_rt_s=5.0)


def scattered_offload(inp: OffloadInput) -> OffloadPlan:
    """Keeps a pseudo-random number of each admitted request's layers, halves some running ones' and
    brings others' back (a function of the ids and the time only, as a policy must be)."""
    def draw(request_id: str, salt: int) -> int:
        return zlib.crc32(f"{request_id}/{inp.now}/{salt}".encode())
    return OffloadPlan(retain={r.request_id: draw(r.request_id, 0) % (LAYERS + 1) for r in inp.admitting},
                       shrink={r.request_id: (r.device_layers or 0) // 2 for r in inp.running
                               if draw(r.request_id, 1) % 3 == 0},
                       restore={r.request_id: 1 + draw(r.request_id, 2) % LAYERS for r in inp.running
                                if draw(r.request_id, 1) % 3 == 1})


registry.HOOKS["layer_offload"]["scattered"] = scattered_offload


def make(strategy: str = "recompute", device_blocks: int = 24, cxl_blocks: int = 16, budget: int = 12,
         allocation: str = "block_at_a_time", order: str = "latest_arrival_first", offload: str = "none",
         car: bool = False, sparsify: bool = False):
    """car: CaR's two-tier prefix cache, its admission (a window of 2) and score replacement;
    sparsify: and nodes that keep part of their tokens in the cxl tier (III-D)."""
    pools = {"device": KVPool("device", device_blocks, SHAPE),
             "cxl": KVPool("cxl", cxl_blocks, SHAPE)}
    policies = Policies({"preemption_strategy": strategy, "kv_allocation": allocation, "preemption_order": order,
                         "layer_offload": offload, **({"prefill_admission": "car", "cache_policy": "car"} if car else {})})
    blocks = BlockManager(pools, LAYERS, policies, cache_cxl=car, high_water=0.75)
    if car and sparsify:
        for tier, pool in pools.items():
            pool.track_tokens(scores=tier == "device")
        blocks.keep_tokens = [BLOCK // 2, 1] + [BLOCK] * (LAYERS - 2)
    return blocks, Scheduler(blocks, policies, max_num_seqs=4, token_budget=budget, allocation=SMALL,
                             staging_cap=4 if offload != "none" else 0,
                             reuse=Reuse(blocks, WindowParams(size=2, max_wait_s=3.0),
                                       link_bandwidth(blocks) if blocks.cache_cxl else 0.0))


def random_targets(rng: random.Random) -> Targets:
    """SLOs in steps of the simulated clock (1 s a step), and an estimate that may be off either way."""
    return Targets(ttft_slo_ms=rng.choice([None, 2e3, 8e3]), tbt_slo_ms=rng.choice([None, 1.5e3, 4e3]),
                   predicted_output_len=rng.choice([None, 1, 3, 8]))


def simulate_step(scheduler: Scheduler, now: float, rng: random.Random) -> None:
    """What the engine does after the model ran: advance, commit full blocks, append a token."""
    plan = scheduler.schedule(now)
    scheduler.blocks.give_back([*plan.staging[0], *plan.staging[1]])  # lent for the model run only
    for chunk in plan.chunks:
        request = chunk.request
        samples = chunk.samples
        request.num_computed += chunk.num_tokens
        scheduler.blocks.commit(request, now)
        if samples:
            request.output_ids.append(rng.randrange(3))
            request.output_times.append(now)
            if len(request.output_ids) >= request.sampling.max_tokens:
                scheduler.finish(request, "length")
    scheduler.blocks.offload_idle()


def live_requests(scheduler: Scheduler) -> list[Request]:
    return [*scheduler.running, *scheduler.waiting, *scheduler.swapped]


def assert_exact_accounting(blocks: BlockManager, scheduler: Scheduler) -> None:
    held: dict[str, Counter] = {tier: Counter() for tier in blocks.pools}
    node_refs: Counter = Counter()
    for request in live_requests(scheduler):
        for layer in request.layers:
            held[layer.tier].update(layer.blocks)
        node_refs.update(request.cached_nodes)
        assert request.num_computed <= request.blocks_per_layer * BLOCK
        assert request.allocation is None or request.status is not Status.RUNNING or \
            request.num_computed <= request.allocation, "a request computed past its allocation"
    idle_named = {tier: {b for node in blocks.evictable.values() if node.tier == tier for b in node.blocks}
                  for tier in blocks.pools}
    # A prefix block a request still holds the node of, in a layer it moved to the cxl tier: cached
    # content the request's table no longer points at (it stays for whoever shares the prefix).
    # A prefix block whose node a request holds while its table no longer points at it (the layer
    # moved to the cxl tier, and maybe back as a private copy): cached content kept for whoever
    # shares the prefix.
    unpointed = {blocks.cached[node_id].blocks[layer] for request in live_requests(scheduler)
                 for node_id in request.cached_nodes for layer, own in enumerate(request.layers)
                 if own.tier != "device" or own.blocks[request.node_ids.index(node_id)] != blocks.cached[node_id].blocks[layer]}
    idle_named["device"] |= unpointed - set(held["device"])
    for tier, pool in blocks.pools.items():
        free = list(pool._free)
        assert len(free) == len(set(free)), f"{tier}: a block is free twice"
        for block in range(pool.num_blocks):
            assert pool.refs(block) == held[tier][block], f"{tier} block {block}"
        # Every block is exactly one of: free, held by requests, or cached and idle.
        parts = [set(free), set(held[tier]), idle_named[tier]]
        assert sum(map(len, parts)) == len(set().union(*parts)) == pool.num_blocks, tier
        if pool.valid is not None:   # a freed block forgets its mask and scores
            assert pool.sparse.keys().isdisjoint(free) and bool(pool.valid[free].all()), f"{tier}: a free block is masked"
            assert pool.scores is None or float(pool.scores[free].abs().sum()) == 0
    scores: Counter = Counter()
    for request in live_requests(scheduler):
        scores.update({node_id: given for node_id, (node, given) in request.scores.items()
                       if blocks.cached.get(node_id) is node})
    for tier, idle in blocks._idle.items():   # the eviction queue: every idle node of the tier, ranked as it is now
        ours = {i: n.view() for i, n in blocks.evictable.items() if n.tier == tier}
        assert len(idle) == len(ours) and all(idle.view(i) == view for i, view in ours.items())
    for node in blocks.cached.values():
        assert node.refs == node_refs[node.node_id]
        assert (node.refs == 0) == (node.node_id in blocks.evictable)
        assert node.score == scores[node.node_id], "a node's score is what live requests added to it"
        assert node.tier == "device" or node.refs == 0, "only device nodes are held"


def assert_everything_returns(blocks: BlockManager, scheduler: Scheduler) -> None:
    for request in live_requests(scheduler):
        scheduler.finish(request, "abort")
    view = blocks.pool_view()
    assert view.free == view.total
    blocks.clear_cache()
    assert all(pool.free_count == pool.num_blocks for pool in blocks.pools.values())


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rng = random.Random(0)
        self.now = 0.0
        self.count = 0

    @initialize(strategy=st.sampled_from(["recompute", "swap", "sweet_spot"]), allocation=st.sampled_from(ALLOCATIONS),
                order=st.sampled_from(["latest_arrival_first", "cacheopt"]), offload=st.sampled_from(["none", "scattered"]),
                car=st.booleans(), sparsify=st.booleans())
    def build(self, strategy, allocation, order, offload, car, sparsify):
        self.blocks, self.scheduler = make(strategy=strategy, allocation=allocation, order=order, offload=offload,
                                           car=car, sparsify=sparsify)

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 2), min_size=1, max_size=14), max_tokens=st.integers(1, 10))
    def add(self, prefix, tail, max_tokens):
        self.count += 1
        self.scheduler.add(Request(f"r{self.count}", prefix + tail, SamplingParams(max_tokens=max_tokens),
                                   self.now, LAYERS, targets=random_targets(self.rng)))

    @precondition(lambda self: self.scheduler.has_work())
    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.now += 1.0
            simulate_step(self.scheduler, self.now, self.rng)

    @precondition(lambda self: live_requests(self.scheduler))
    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from(live_requests(self.scheduler)))
        self.scheduler.finish(request, "abort")

    @invariant()
    def accounting_is_exact(self):
        assert_exact_accounting(self.blocks, self.scheduler)

    @invariant()
    def no_more_is_allotted_than_there_is(self):
        assert self.scheduler.ledger.headroom() >= 0

    def teardown(self):
        assert_everything_returns(self.blocks, self.scheduler)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("offload", ["none", "scattered"])
@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_every_request_finishes_under_pressure_with_both_strategies(allocation, offload):
    """No request is starved, whatever the allocation policy, however wrong the estimates, and with
    layers kept off the device or not."""
    for strategy in ("recompute", "swap"):
        blocks, scheduler = make(strategy=strategy, device_blocks=12, budget=8, allocation=allocation, offload=offload)
        rng = random.Random(1)
        requests = [Request(f"r{i}", [rng.randrange(3) for _ in range(rng.randint(3, 9))],
                            SamplingParams(max_tokens=rng.randint(3, 8)), float(i), LAYERS,
                            targets=random_targets(rng)) for i in range(8)]
        for request in requests:
            scheduler.add(request)
        for step in range(500):
            if not scheduler.has_work():
                break
            simulate_step(scheduler, float(step), rng)
            assert_exact_accounting(blocks, scheduler)
        assert all(r.status is Status.FINISHED and r.finish_reason == "length" for r in requests)
        if allocation == "block_at_a_time" and offload == "none":
            assert sum(r.preemptions for r in requests) > 0, "the pool was meant to be too small to avoid preemption"
        assert_everything_returns(blocks, scheduler)


def test_fully_cached_prompt_writes_its_last_token_into_a_copy():
    blocks, scheduler = make()
    blocks.device.tensor.copy_(torch.arange(blocks.device.tensor.numel(), dtype=torch.float32).view_as(
        blocks.device.tensor))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]                      # two full blocks
    first = Request("first", prompt, SamplingParams(max_tokens=1), 0.0, LAYERS)
    scheduler.add(first)
    simulate_step(scheduler, 1.0, random.Random(0))           # computes, caches both blocks, finishes
    assert first.finish_reason == "length" and len(blocks.cached) == 2
    cached_last = blocks.cached[first.node_ids[1]].blocks
    before = blocks.device.tensor[cached_last].clone()

    second = Request("second", prompt, SamplingParams(max_tokens=4), 2.0, LAYERS)
    scheduler.add(second)
    plan = scheduler.schedule(3.0)
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("second", 1)]  # only the last token
    assert second.num_computed == 7 and blocks.hit_tokens == 7
    own_last = [layer.blocks[1] for layer in second.layers]
    assert set(own_last).isdisjoint(cached_last)                # copy-on-write gave it its own last block
    assert torch.equal(blocks.device.tensor[own_last], before)  # ... holding the same KV
    assert [layer.blocks[0] for layer in second.layers] == blocks.cached[first.node_ids[0]].blocks  # shared
    assert_exact_accounting(blocks, scheduler)
    assert_everything_returns(blocks, scheduler)


RANKED: Counter = Counter()


def counting_lru(node):
    RANKED[node.node_id] += 1
    return lru(node)


registry.HOOKS["cache_policy"]["counting_lru"] = counting_lru


def test_the_cache_policy_ranks_a_node_when_it_goes_idle_not_every_idle_node_per_allocation():
    """Making room costs a heap pop per node evicted: with a full cache, each new prompt evicts the
    least recently used prefix, and no node is ranked more than once (it never changed while idle)."""
    RANKED.clear()
    blocks, scheduler = make(device_blocks=8)
    blocks.policies.set({"cache_policy": "counting_lru"})
    rng = random.Random(0)
    prompts = [[i] * BLOCK + [0] for i in range(1, 13)]   # one full block each: a node of 2 blocks (2 layers)
    for i, prompt in enumerate(prompts):
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=1), float(i), LAYERS))
        simulate_step(scheduler, float(i), rng)
        assert len(blocks.cached) == min(i + 1, 3)   # 8 blocks: 3 nodes cached, room for the 4th prompt's blocks
    assert len(RANKED) == len(prompts) and set(RANKED.values()) == {1}
    assert [blocks.cached[n].node_id for n in blocks.evictable] == list(blocks.evictable)
    assert_everything_returns(blocks, scheduler)


def test_a_cache_policy_switched_at_run_time_orders_the_next_eviction():
    blocks, scheduler = make(device_blocks=8)
    rng = random.Random(0)
    for i, prompt in enumerate(([1, 1, 1, 1, 2], [3, 3, 3, 3, 4], [5, 5, 5, 5, 6])):
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=1), float(i), LAYERS))
        simulate_step(scheduler, float(i), rng)
    oldest, middle, newest = blocks.evictable.values()
    blocks.add_score(Request("x", [0], SamplingParams(max_tokens=1), 0.0, LAYERS), [oldest], 1)
    blocks.policies.set({"cache_policy": "car"})   # now the oldest, scored, outranks the others
    assert blocks._evict("device", 1) == 1
    assert set(blocks.cached) == {oldest.node_id, newest.node_id}


def test_cache_policy_evicts_idle_prefixes_when_the_pool_needs_room():
    blocks, scheduler = make(device_blocks=8)
    rng = random.Random(0)
    for i, prompt in enumerate(([1, 1, 1, 1, 2], [3, 3, 3, 3, 4])):
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=1), float(i), LAYERS))
        simulate_step(scheduler, float(i), rng)
    older, newer = list(blocks.evictable)
    assert blocks.device.free_count == 4
    big = Request("big", [9] * 13, SamplingParams(max_tokens=1), 5.0, LAYERS)   # needs 4 blocks per layer
    scheduler.add(big)
    simulate_step(scheduler, 6.0, rng)   # a 12-token chunk (the budget): 3 blocks per layer, LRU prefix evicted
    assert list(blocks.evictable) == [newer]
    simulate_step(scheduler, 7.0, rng)   # the last token: a 4th block per layer, the other prefix evicted
    assert big.finish_reason == "length" and older not in blocks.cached and newer not in blocks.cached
    assert_everything_returns(blocks, scheduler)
