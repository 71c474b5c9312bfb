"""A turn refused for want of room costs nothing (issue 31): a waiting request whose cached prefix sits
in the cxl tier, tried at every step while the device has no room for it, reloads nothing (no bytes
loaded, its nodes stay in the cxl tier, no counter moves) until the room is there; then it is
admitted with its prefix reloaded once. As vLLM's scheduler, which looks the prefix up, asks for
the blocks, and leaves a request it cannot place waiting with nothing copied. The native engine's
scheduler over its BlockManager and the simulator over its count of blocks (sim/prefix_count.py)
answer alike, step by step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.policies.allocation import AllocationParams
from kvmesh.policies.allocation.plan import AllocationInput, AllocationPlan, Grant
from kvmesh.policies.iteration import Policies
from kvmesh.services.engine.kv_blocks import BlockShape
from kvmesh.services.engine.native.block_manager import BlockManager
from kvmesh.services.engine.native.kv_pool import KVPool
from kvmesh.services.engine.native.request import Request
from kvmesh.services.engine.native.scheduler import Scheduler
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

LAYERS, BLOCK = 2, 4
SHAPE = BlockShape(block_size=BLOCK, num_kv_heads=1, head_dim=2, dtype=torch.float32)
# 10 blocks a layer on the device, 20 in the cxl tier; every idle node moves out after a step (high
# water 0), so a node reloaded for a turn that is then refused would go out again.
SPEC = EngineSpec(block_size=BLOCK, num_layers=LAYERS, device_blocks=2 * 10, max_num_seqs=4, token_budget=64,
                  cxl_blocks=2 * 20, block_bytes=SHAPE.bytes, prefix_caching=True, cache_cxl=True,
                  cache_high_water=0.0)
NODE_BYTES = LAYERS * SHAPE.bytes
FIRST = list(range(1, 9))             # an earlier turn: two full blocks, their nodes put in the cxl tier
HOG = list(range(100, 132))           # 32 tokens (8 blocks a layer), then 9 blocks while it decodes
TURN = FIRST + [0, 50, 51, 52]        # the next turn: the earlier turn's two nodes and a block of its own


class NativeSide:
    """The native engine's scheduler and BlockManager, with what its step does around the model
    (services/engine/native/engine.py), the model left out: every answer token is 0."""

    def __init__(self, policies: dict[str, str], layerwise: bool, spec: EngineSpec = SPEC,
                 allocation: AllocationParams = AllocationParams()):
        hooks = Policies(policies)
        pools = {"device": KVPool("device", spec.device_blocks, SHAPE), "cxl": KVPool("cxl", spec.cxl_blocks, SHAPE)}
        self.blocks = BlockManager(pools, LAYERS, hooks, cache_cxl=True, high_water=spec.cache_high_water)
        self.blocks.layerwise_reload = layerwise
        self.scheduler = Scheduler(self.blocks, hooks, spec.max_num_seqs, spec.token_budget, allocation)

    def add(self, request_id: str, prompt: list[int], out: int, now: float) -> None:
        self.scheduler.add(Request(request_id, prompt, SamplingParams(max_tokens=out), now, LAYERS))

    def step(self, now: float) -> None:
        plan = self.scheduler.schedule(now)
        if not plan.chunks:
            self.blocks.flush_loads()
            return
        self.blocks.loads_done()
        for chunk in plan.chunks:
            chunk.request.num_computed += chunk.num_tokens
            self.blocks.commit(chunk.request, now + 0.5)
        for request in [c.request for c in plan.chunks if c.request.num_computed == c.request.num_tokens]:
            request.output_ids.append(0)
            if len(request.output_ids) >= request.sampling.max_tokens:
                self.scheduler.finish(request, "length")
        self.blocks.offload_idle()

    @property
    def loaded_bytes(self) -> int:
        return self.blocks.moved_bytes["device"]


class SimSide:
    """The simulated engine (sim/engine.py), its requests naming their blocks as the native engine does."""

    def __init__(self, policies: dict[str, str], spec: EngineSpec = SPEC,
                 allocation: AllocationParams = AllocationParams()):
        self.engine = SimEngine(spec, StepCost(a=0.5, b=0.0, c=0.0), policies, allocation)
        self.blocks = self.engine.blocks
        self.scheduler = self.engine.scheduler

    def add(self, request_id: str, prompt: list[int], out: int, now: float) -> None:
        names = tuple(node_ids(prompt + [0] * out, BLOCK))
        self.engine.add(SimRequest(request_id, now, len(prompt), out, block_names=names))

    def step(self, now: float) -> None:
        step = self.engine.schedule(now)
        if step.chunks:
            self.engine.complete(step, now + 0.5)

    @property
    def loaded_bytes(self) -> int:
        return self.blocks.copied["load"]


def state(side) -> tuple:
    """What a refused turn must leave as it was: who waits, bytes loaded, nodes moved and found, the
    earlier turn's nodes' tiers and hits."""
    blocks = side.blocks
    first = [blocks.cached[name] for name in node_ids(FIRST, BLOCK)]
    return ([r.request_id for r in side.scheduler.waiting], side.loaded_bytes, dict(blocks.moved_nodes),
            dict(blocks.hit_blocks), blocks.hit_tokens, blocks.lookup_blocks,
            [(node.tier, node.hits, node.last_access) for node in first])


SIDES = {"native": lambda policies, spec=SPEC, allocation=AllocationParams():
             NativeSide(policies, True, spec, allocation),
         "native-whole-reload": lambda policies, spec=SPEC, allocation=AllocationParams():
             NativeSide(policies, False, spec, allocation),
         "sim": SimSide}
POLICIES = [{}, {"cache_policy": "car"}]


def run(side, turn: list[int] = TURN) -> list[tuple]:
    """The earlier turn served alone (its nodes then idle, moved to the cxl tier); then a request that
    holds the device for four steps, and the next turn behind it. The state after each step."""
    side.add("first", FIRST, 1, 0.0)
    side.step(0.0)
    side.add("hog", HOG, 4, 1.0)
    side.add("turn", turn, 2, 1.0)
    states = []
    for k in range(1, 7):
        side.step(float(k))
        states.append(state(side))
    return states


@pytest.mark.parametrize("turn", [TURN, FIRST], ids=["new-block", "fully-cached"])
@pytest.mark.parametrize("policies", POLICIES, ids=["lru", "car"])
@pytest.mark.parametrize("side", list(SIDES))
def test_a_turn_refused_for_want_of_room_reloads_nothing_until_it_fits(side, policies, turn):
    """A fully cached turn needs as much room as one with a block of its own: its two nodes, and a
    copy of the last for its last token."""
    states = run(SIDES[side](policies), turn)

    looked_up = 2 + 8   # the earlier turn's full blocks and the hog's, none of the hog's found
    # Tried at each of the hog's four steps (the hog's 8, then 9 blocks a layer leave 4, then 2 of the
    # device's 20 free; the turn needs 6), it waits with nothing loaded or moved; after the fourth the
    # hog has ended, its 8 nodes gone idle to the cxl tier.
    for k in range(4):
        moved = {"cxl": 2 + 8 * (k == 3)}
        assert states[k] == (["turn"], 0, moved, {}, 0, looked_up, [("cxl", 0, 0.5)] * 2), f"step {k + 1}"
    # The turn is admitted at step 5, its two nodes reloaded once and found in the cxl tier (a fully
    # cached turn then writes into its copy of the last, let go and moved out after the step).
    fully = len(turn) == 2 * BLOCK
    waiting, loaded, moved, found, hit_tokens, looked_up_now, first = states[4]
    assert (waiting, loaded, moved, found, hit_tokens, looked_up_now) == \
        ([], 2 * NODE_BYTES, {"cxl": 2 + 8 + fully, "device": 2}, {"cxl": 2}, min(2 * BLOCK, len(turn) - 1),
         looked_up + len(turn) // BLOCK)
    assert [tier for tier, *_ in first] == ["device", "cxl" if fully else "device"]
    assert states[5][1] == 2 * NODE_BYTES   # and never again


@pytest.mark.parametrize("turn", [TURN, FIRST], ids=["new-block", "fully-cached"])
@pytest.mark.parametrize("policies", POLICIES, ids=["lru", "car"])
def test_the_simulator_refuses_and_admits_the_turn_as_the_native_engine(policies, turn):
    assert run(SimSide(policies), turn) == run(NativeSide(policies, layerwise=True), turn)


@pytest.mark.parametrize("turn", [TURN, FIRST], ids=["new-block", "fully-cached"])
@pytest.mark.parametrize("side", list(SIDES))
def test_a_turn_is_admitted_as_soon_as_its_room_is_there(side, turn):
    """One block a layer more on the device (11): beside the hog's 8 the turn's 6 fit, at once."""
    states = run(SIDES[side]({}, replace(SPEC, device_blocks=2 * 11)), turn)
    waiting, loaded, moved, found, hit_tokens, *_ = states[0]
    assert (waiting, loaded, moved["device"], found) == ([], 2 * NODE_BYTES, 2, {"cxl": 2})
    assert hit_tokens == min(2 * BLOCK, len(turn) - 1)


def what_is_left(batch: AllocationInput) -> AllocationPlan:
    """An allocation policy a package may bring (the kv_allocation hook): each waiting request its
    prompt and B tokens, or what the step's unallocated KV has left when that is less; the ledger
    grows it on demand. (The built-in ones allot a waiting request at least its whole prompt, so the
    ledger refuses them at their grant, Ledger.allot, and never when their prefix is weighed.)"""
    left, grants = batch.unallocated, []
    for request in batch.waiting:
        tokens = min(request.num_tokens + batch.params.block_tokens, left)
        left -= tokens
        grants.append(Grant(request.request_id, tokens))
    return AllocationPlan(grants=tuple(grants))


ROOMY = replace(SPEC, device_blocks=2 * 14)   # the turn's 6 blocks fit beside the hog's 8, then 9


@pytest.mark.parametrize("side", list(SIDES))
def test_a_turn_the_ledger_cannot_grow_to_its_prefix_reloads_nothing_until_it_can(side):
    """The device has the turn's room, the ledger does not: the hog is allotted its 32 tokens and B = 16
    (12 blocks a layer, none to reclaim: it keeps B ahead), so the turn is allotted the 8 tokens left
    and cannot grow to the 12 its prefix and new block need. It waits with nothing loaded, moved or
    counted (the scheduler's ledger check before the prefix is attached) until the hog ends; then,
    allotted its prompt, it is admitted with its two nodes reloaded once."""
    built = SIDES[side]({}, ROOMY, AllocationParams(block_tokens=16, reserved_blocks=0))
    built.scheduler.policies.kv_allocation = what_is_left
    states = run(built)
    for k in range(4):
        moved = {"cxl": 2 + 8 * (k == 3)}
        assert states[k] == (["turn"], 0, moved, {}, 0, 10, [("cxl", 0, 0.5)] * 2), f"step {k + 1}"
    assert states[4][:5] == ([], 2 * NODE_BYTES, {"cxl": 10, "device": 2}, {"cxl": 2}, 2 * BLOCK)
    assert built.scheduler.ledger.grown == {"unallocated": 0, "reserved": 0, "reclaimed": 0}

    # B = 8: the turn is allotted 16 tokens, its 12 without growing, and is admitted at once.
    built = SIDES[side]({}, ROOMY, AllocationParams(block_tokens=8, reserved_blocks=0))
    built.scheduler.policies.kv_allocation = what_is_left
    assert run(built)[0][:4] == ([], 2 * NODE_BYTES, {"cxl": 2, "device": 2}, {"cxl": 2})
