"""The simulator's prefix cache (sim/prefix_count.py) from the outside: what a request finds cached, what
is evicted and where to, and what a step waits for. (Step by step against the native BlockManager:
test_one_scheduler.py.)"""

from __future__ import annotations

import pytest

from kvmesh.policies.cache import car, lru
from kvmesh.policies.cache.node_table import PrefixHit
from kvmesh.policies.cache.replacement import UNCLAIMED_SCORE
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.prefix_count import PrefixCount
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

BLOCK, LAYERS, BYTES = 4, 2, 1000


def count(device: int = 20, cxl: int = 0, rank=lru) -> PrefixCount:
    return PrefixCount(BLOCK, LAYERS, {"device": device} | ({"cxl": cxl} if cxl else {}), rank, BYTES,
                       cache_cxl=bool(cxl))


def turn(request_id: str, names: str, prompt: int, out: int = 1) -> SimRequest:
    """A request whose full blocks are named by the letters of `names`."""
    return SimRequest(request_id, 0.0, prompt, out, block_names=tuple(names))


def served(blocks: PrefixCount, request: SimRequest, now: float) -> None:
    """Admitted, its prompt computed and committed, then ended."""
    blocks.attach_prefix(request, now)
    assert blocks.reserve(request, -(-request.prompt_len // BLOCK), request.prompt_len - request.num_computed)
    request.num_computed = request.prompt_len
    blocks.commit(request, now)
    blocks.forget_scores(request)
    blocks.release(request)


def test_a_later_turn_finds_the_earlier_turns_blocks_and_holds_them():
    blocks = count()
    served(blocks, turn("t0", "ab", 9), now=1.0)   # 3 blocks a layer, 2 of them full and named
    assert blocks.free("device") == 20 and blocks.free_blocks["device"] == 16  # the 2 nodes are idle

    later = turn("t1", "abc", 14)
    assert blocks.attach_prefix(later, now=2.0) == 8
    assert later.cached_nodes == ["a", "b"] and later.blocks_per_layer == 2
    assert blocks.free("device") == 16   # the held nodes are not free, nothing else is taken
    assert blocks.reserve(later, 4, 6)
    assert blocks.free("device") == 12
    assert (blocks.hit_tokens, blocks.hit_blocks["device"], blocks.cached["a"].hits) == (8, 2, 1)


def test_a_fully_cached_prompt_recomputes_its_last_token_into_its_own_copy():
    blocks = count()
    served(blocks, turn("t0", "ab", 8), now=1.0)
    again = turn("t1", "ab", 8)
    assert blocks.attach_prefix(again, now=2.0) == 7
    assert blocks.reserve(again, 2, 1)          # block "b" is written: copied, let go
    assert again.cached_nodes == ["a"] and blocks.free("device") == 20 - 2 * LAYERS  # a held, and the copy
    assert blocks.cached["b"].refs == 0


@pytest.mark.parametrize("rank, evicted", [(lru, "x"), (car, "y")])
def test_room_comes_from_idle_nodes_in_the_cache_policys_order(rank, evicted):
    """Both claimed by live requests (no unclaimed node to take first): x went idle first (LRU's
    victim); y is scored lower (CaR's victim: fewer will reuse it)."""
    blocks = count(device=4, rank=rank)
    served(blocks, turn("x", "x", 4), now=1.0)
    keeper = turn("y-user", "y", 5)
    served(blocks, turn("y", "y", 4), now=2.0)
    blocks.add_score(keeper, [blocks.cached["x"]], 2)  # live requests will reuse x, and y
    blocks.add_score(keeper, [blocks.cached["y"]], 1)
    assert blocks.free_blocks["device"] == 0
    big = turn("z", "", 3)
    assert blocks.reserve(big, 1, 3)
    assert set(blocks.cached) == {"x", "y"} - {evicted}


def test_car_moves_evicted_nodes_to_the_cxl_tier_and_a_hit_brings_them_back():
    blocks = count(device=4, cxl=4)
    served(blocks, turn("t0", "ab", 8), now=1.0)
    other = turn("o", "", 5)
    assert blocks.reserve(other, 2, 5)          # the device's 4 blocks: both nodes go to the cxl tier
    assert [blocks.cached[n].tier for n in "ab"] == ["cxl", "cxl"]
    assert blocks.copied["offload"] == 2 * LAYERS * BYTES
    blocks.release(other)

    back = turn("t1", "abc", 13)
    assert blocks.attach_prefix(back, now=3.0) == 8   # reloaded at its turn, held
    assert blocks.copied["load"] == 2 * LAYERS * BYTES
    assert blocks.free_blocks["cxl"] == 0            # their cxl copies until the step has loaded them
    blocks.loads_done()
    assert blocks.free_blocks["cxl"] == 4 and blocks.hit_blocks["cxl"] == 2


def test_looking_a_prefix_up_attaches_moves_and_counts_nothing():
    """What attaching would give and take of the device (its idle nodes held, its cxl nodes reloaded),
    found with nothing changed: the scheduler asks before it attaches."""
    blocks = count(device=8, cxl=4)
    served(blocks, turn("t0", "ab", 8), now=1.0)
    other = turn("o", "", 12)
    assert blocks.reserve(other, 3, 12)    # 6 of the device's 8: the deeper node goes to the cxl tier
    assert [blocks.cached[n].tier for n in "ab"] == ["device", "cxl"]

    def unchanged() -> tuple:
        return (dict(blocks.copied), dict(blocks.moved_nodes), dict(blocks.hit_blocks), blocks.hit_tokens,
                blocks.lookup_blocks, blocks.free("device"), blocks.free("cxl"),
                [(n.tier, n.refs, n.hits, n.last_access) for n in blocks.cached.values()])

    before = unchanged()
    assert blocks.find_prefix(turn("t1", "abc", 13)) == PrefixHit(nodes=2, tokens=8, taken=2 * LAYERS)
    assert blocks.find_prefix(turn("t2", "ab", 8)) == PrefixHit(nodes=2, tokens=7, taken=2 * LAYERS)
    assert blocks.find_prefix(turn("t3", "xy", 8)) == PrefixHit()
    assert unchanged() == before

    blocks.release(other)
    assert blocks.attach_prefix(turn("h", "ab", 9), now=2.0) == 8   # holds both, b reloaded
    blocks.loads_done()
    assert blocks.find_prefix(turn("t4", "abc", 13)) == PrefixHit(nodes=2, tokens=8, taken=0)


@pytest.mark.parametrize("admission", ["fcfs", "car"])
def test_a_step_lasts_at_least_the_reloads_begun_with_it(admission):
    """The reload at a request's turn runs layer by layer inside its step (CaR III-C.1): the step
    lasts its compute or the copy, the longer. With CaR's admission too: the prefetcher loads only
    for requests still waiting once the step has admitted its own, since a whole-node prefetch of a
    turn admitted in the same step would hold it up until every layer landed."""
    spec = EngineSpec(block_size=BLOCK, num_layers=LAYERS, device_blocks=12, max_num_seqs=4, token_budget=64,
                      cxl_blocks=8, block_bytes=BYTES, swap_out_bytes_per_s=1e3, swap_in_bytes_per_s=2e3,
                      prefix_caching=True, cache_cxl=True, cache_high_water=0.5)
    engine = SimEngine(spec, StepCost(a=0.5, b=0.0, c=0.0), {"cache_policy": "car", "prefill_admission": admission})
    first = SimRequest("a", 0.0, 16, 1, block_names=tuple("abcd"))
    engine.add(first)
    step = engine.schedule(0.0)
    engine.complete(step, engine.seconds(step))
    assert first.finished_at == 0.5
    # 8 of 12 blocks in use, past the high-water mark's 6: the deepest node moves out after the step
    # (its copy out lands at 2.5 s).
    assert {name: node.tier for name, node in engine.blocks.cached.items()} == \
        {"a": "device", "b": "device", "c": "device", "d": "cxl"}

    second = SimRequest("b", 3.0, 17, 1, block_names=tuple("abcd"))
    engine.add(second)
    step = engine.schedule(3.0)
    copy_s = LAYERS * BYTES / 2e3
    assert second.num_cached == 16 and copy_s == 1.0
    assert (step.cache_offload_s, step.cache_load_s) == (0.0, pytest.approx(copy_s))
    assert engine.seconds(step) == pytest.approx(copy_s)
    assert engine.scheduler.reuse.prefetched == 0


def test_the_engine_runs_the_cache_policy_hook_only_with_the_prefix_cache():
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineSpec(cxl_blocks=8, block_bytes=BYTES, cache_cxl=True)
    engine = SimEngine(EngineSpec(prefix_caching=True), StepCost(a=0.1, b=0.0, c=0.0), {"cache_policy": "car"})
    assert engine.blocks._idle["device"].rank is car


def test_idle_device_nodes_count_what_a_prefetch_may_take():
    """NodeTable.idle_device_nodes: idle device nodes scored at most the bound, others' not counted."""
    blocks = count()
    served(blocks, turn("t0", "abc", 12), now=1.0)   # three idle device nodes, unclaimed
    a, b, c = (blocks.cached[name] for name in "abc")
    assert blocks.idle_device_nodes(UNCLAIMED_SCORE) == 3
    assert blocks.idle_device_nodes(UNCLAIMED_SCORE, excluding=[a, c]) == 1
    waiting = turn("t1", "ab", 9)
    blocks.add_score(waiting, [a], 5)                # claimed by a waiting turn: a prefetch may not take it
    assert blocks.idle_device_nodes(UNCLAIMED_SCORE) == 2 and blocks.idle_device_nodes(5) == 3
    held = turn("t2", "a", 5)
    blocks.attach_prefix(held, now=2.0)              # held: no longer idle
    assert blocks.idle_device_nodes(5) == 2 and b.refs == 0
