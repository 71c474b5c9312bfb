"""CaR in the engine: prefix-cache nodes the device evicts move to the cxl tier with every byte, come
back on a hit (or ahead of it, prefetched), and a multi-turn conversation reusing them answers
token for token as recomputing it would; scores go back to zero and every block comes back."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvmesh.libs.controlplane import ConfigError
from kvmesh.libs.messages.engine import SamplingParams

from .conftest import assert_all_blocks_free, engine_for, run_all

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CAR = {"prefill_admission": "car", "cache_policy": "car"}


def conversation(engine, turns: list[list[int]]) -> list[list[int]]:
    """Each turn's prompt is the history (earlier prompts and answers) plus a new message; returns
    the answers."""
    history, answers = [], []
    for message in turns:
        request = run_all(engine, [history + message], GREEDY)[0]
        answers.append(request.output_ids)
        history = history + message + request.output_ids
    return answers


def turns(n: int, seed: int, length: int = 40) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 200, (length,), generator=generator).tolist() for _ in range(n)]


@pytest.mark.parametrize("admission,thread", [("car", False), ("fcfs", False), ("fcfs", True)])
def test_a_conversation_reusing_nodes_from_the_cxl_tier_answers_as_recomputing_does(tiny_checkpoint, admission,
                                                                                    thread):
    recompute = engine_for(tiny_checkpoint, prefix_caching=False)
    # A device tier of about one conversation's context: earlier turns' nodes go to the cxl tier
    # while other conversations run, and come back for the next turn, reloaded layer by layer in
    # the step of the request that hits them (its copies inline, or started at once on a copy
    # thread). Each turn runs alone, admitted in the step it arrives for, so CaR's prefetcher, which
    # loads only for requests left waiting, has nothing to do (its own test is below).
    car = engine_for(tiny_checkpoint, policies={**CAR, "prefill_admission": admission}, prefix_cache_cxl=True,
                     device_blocks=4 * 24, cxl_blocks=4 * 96, layer_copy_thread=thread)
    talks = [turns(4, seed) for seed in range(3)]
    expected = [conversation(recompute, talk) for talk in talks]
    got = [[], [], []]
    history = [[], [], []]
    for turn in range(4):   # interleaved: each turn of one conversation pushes the others' nodes out
        for c, talk in enumerate(talks):
            request = run_all(car, [history[c] + talk[turn]], GREEDY)[0]
            got[c].append(request.output_ids)
            history[c] += talk[turn] + request.output_ids
    assert got == expected
    state = car.state()
    assert state.prefix_cache_moved_nodes["cxl"] > 0 and state.prefix_cache_moved_nodes["device"] > 0
    assert state.prefix_cache_hit_blocks["cxl"] > 0 and car.scheduler.reuse.prefetched == 0
    assert all(node.score == 0 for node in car.blocks.cached.values())
    assert_all_blocks_free(car)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.float().numpy().tobytes()).hexdigest()


def test_moving_a_node_between_tiers_keeps_every_byte(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, prefix_cache_cxl=True)
    run_all(engine, turns(1, seed=7, length=64), GREEDY)
    blocks = engine.blocks
    nodes = list(blocks.cached.values())
    before = {n.node_id: digest(blocks.device.tensor[n.blocks]) for n in nodes}
    blocks._evict("device", len(nodes))        # what the device does when it needs the room
    assert {n.tier for n in nodes} == {"cxl"}
    assert {n.node_id: digest(blocks.pools["cxl"].tensor[n.blocks]) for n in nodes} == before
    assert blocks.reload(nodes) == len(nodes)
    assert {n.tier for n in nodes} == {"device"}
    assert {n.node_id: digest(blocks.device.tensor[n.blocks]) for n in nodes} == before
    assert_all_blocks_free(engine)


def test_idle_nodes_move_out_past_the_high_water_mark(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, prefix_cache_cxl=True, device_blocks=4 * 16, cache_high_water=0.5)
    run_all(engine, turns(1, seed=8, length=200), GREEDY)   # 13 of 16 blocks a layer, cached when done
    device = engine.blocks.device
    assert device.num_blocks - device.free_count <= 0.5 * device.num_blocks
    assert engine.state().prefix_cache_nodes["cxl"] > 0
    assert_all_blocks_free(engine)


def test_the_prefetcher_brings_a_window_request_s_nodes_back_before_its_turn(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, policies=CAR, prefix_cache_cxl=True, max_num_seqs=1)
    first = turns(1, seed=9, length=64)[0]
    run_all(engine, [first], GREEDY)
    engine.blocks._evict("device", len(engine.blocks.cached))   # the conversation's nodes now in the cxl tier
    # One request runs (max_num_seqs 1); the next turn waits in the window; with nothing measured
    # yet about when the running one ends the prefetcher loads at once.
    busy = engine.add("busy", turns(1, seed=10)[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()
    follow_up = engine.add("next", first + turns(1, seed=11)[0], GREEDY)
    engine.scheduler.iteration_s.clear()
    engine.step()
    assert follow_up.window_since is not None and engine.scheduler.reuse.prefetched > 0
    while engine.scheduler.has_work():
        engine.step()
    assert busy.finished and follow_up.finished and follow_up.num_cached >= 64 - 16
    assert engine.state().prefix_cache_hit_blocks["device"] >= 4
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("thread", [False, True])
def test_a_prefetch_is_copied_under_the_next_step_not_in_the_scheduler_s_pass(tiny_checkpoint, thread):
    """The prefetcher gives a waiting turn's cxl nodes their device blocks in the scheduler's pass
    and leaves the copy to the model's run that follows (inline, or on the copy thread), which no
    layer's attention waits for: no request of that step holds them. Once the step is done they
    hold their KV, and the turn answers as recomputing would."""
    first, message = turns(1, seed=9, length=64)[0], turns(1, seed=11)[0]
    expected = run_all(engine_for(tiny_checkpoint, prefix_caching=False), [first + message], GREEDY)[0].output_ids
    engine = engine_for(tiny_checkpoint, policies=CAR, prefix_cache_cxl=True, max_num_seqs=1,
                        layer_copy_thread=thread)
    blocks = engine.blocks
    run_all(engine, [first], GREEDY)
    nodes = list(blocks.cached.values())
    left = [block for node in nodes for block in node.blocks]
    blocks._evict("device", len(nodes))                        # the conversation's 4 nodes to the cxl tier
    blocks.device.tensor[left] = float("nan")                  # the device blocks they left hold nothing of theirs
    kv = {n.node_id: digest(blocks.pools["cxl"].tensor[n.blocks]) for n in nodes}
    busy = engine.add("busy", turns(1, seed=10)[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()
    follow_up = engine.add("next", first + message, GREEDY)
    engine.scheduler.iteration_s.clear()   # nothing measured of when busy ends: fetch(t) loads at once
    at_the_model = []
    run = engine.runner.run

    def observed(chunks, *args, **kwargs):   # the state the scheduler's pass left, as the model starts
        at_the_model.extend((n.tier, n.node_id in blocks.evictable,
                             digest(blocks.device.tensor[n.blocks]) == kv[n.node_id]) for n in nodes)
        return run(chunks, *args, **kwargs)

    engine.runner.run = observed
    engine.step()
    engine.runner.run = run
    assert engine.scheduler.reuse.prefetched == len(nodes) and follow_up.num_computed == 0
    assert at_the_model == [("device", False, False)] * len(nodes)   # on the device, pinned, not copied yet
    assert all(n.tier == "device" and n.node_id in blocks.evictable for n in nodes)   # landed, let go
    assert {n.node_id: digest(blocks.device.tensor[n.blocks]) for n in nodes} == kv
    while engine.scheduler.has_work():
        engine.step()
    assert busy.finished and follow_up.output_ids == expected and follow_up.num_cached == 64
    assert engine.state().prefix_cache_hit_blocks["device"] >= len(nodes)
    assert_all_blocks_free(engine)


def test_prefix_cache_cxl_without_a_cxl_tier_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="prefix_cache_cxl"):
        engine_for(tiny_checkpoint, prefix_cache_cxl=True, cxl_blocks=0, cxl_bytes=0)


def test_the_journal_tells_the_publisher_what_was_cached_moved_and_dropped(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, prefix_cache_cxl=True)
    blocks = engine.blocks
    blocks.take_cache_changes()   # what the publisher does first: the journal starts
    run_all(engine, turns(1, seed=12, length=48), GREEDY)
    cached, dropped = blocks.take_cache_changes()
    assert {n.tier for n in cached} == {"device"} and len(cached) == 3 and dropped == []
    assert {n.score for n in cached} == {0}   # rescored when its request ended: published with it
    blocks._evict("device", 3)
    cached, _ = blocks.take_cache_changes()
    assert {n.tier for n in cached} == {"cxl"} and len(cached) == 3
    blocks.note_cache_changes([cached[0].node_id])   # a send that failed: journalled again as it is now
    assert blocks.take_cache_changes() == ([cached[0]], [])
    blocks.clear_cache()
    assert blocks.take_cache_changes() == ([], [n.node_id for n in cached])
    assert_all_blocks_free(engine)


def test_a_prefetch_uses_only_room_no_live_request_will_reuse(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, prefix_cache_cxl=True, device_blocks=4 * 8, cache_high_water=1.0)
    blocks = engine.blocks
    first, second = turns(1, seed=13, length=64)[0], turns(1, seed=14, length=112)[0]
    run_all(engine, [first], SamplingParams(max_tokens=1, temperature=0.0))
    cold = list(blocks.cached.values())
    blocks._evict("device", len(cold))                       # first's 4 nodes to the cxl tier
    run_all(engine, [second], SamplingParams(max_tokens=1, temperature=0.0))   # 7 nodes: 1 block a layer left
    wanted = [n for n in blocks.cached.values() if n.tier == "device"]
    for node in wanted:
        node.score = 1                                      # as if a window request will reuse them
    assert blocks.reload(cold, spare_only=True) == 1        # the free block only
    assert blocks.reload(cold, spare_only=True) == 0        # then none: the idle nodes left are claimed or its own
    assert all(n.tier == "device" for n in wanted)
    assert blocks.reload(cold) == 3                         # at the request's turn: whatever room it takes
    for node in wanted:
        node.score = 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("prefetch", [False, True])
def test_reloads_left_pending_by_a_step_that_runs_nothing_are_copied_then(tiny_checkpoint, prefetch):
    engine = engine_for(tiny_checkpoint, prefix_cache_cxl=True)
    blocks = engine.blocks
    run_all(engine, turns(1, seed=15, length=64), GREEDY)
    nodes = list(blocks.cached.values())
    before = {n.node_id: digest(blocks.device.tensor[n.blocks]) for n in nodes}
    blocks._evict("device", len(nodes))
    # as a request whose admission then fell through, or the prefetcher's
    assert blocks.reload(nodes, spare_only=prefetch, layerwise=True) == len(nodes)
    assert all(n.tier == "device" and n.node_id not in blocks.evictable for n in nodes)   # pinned while pending
    engine.step()                                               # nothing to run: the copies are made now
    assert blocks.layer_loads() is None and all(n.node_id in blocks.evictable for n in nodes)
    assert {n.node_id: digest(blocks.device.tensor[n.blocks]) for n in nodes} == before
    assert_all_blocks_free(engine)
