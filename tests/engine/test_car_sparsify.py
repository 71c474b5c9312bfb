"""CaR III-D in the engine: observation queries score the tokens, a node moving to the cxl tier keeps
each layer's best-scored ones (only those are copied, and masked everywhere the node goes), the
profile's ratios stay within the quality bound (explicit ones over it are refused), and with
nothing dropped the answers are bit-identical to the engine without sparsification."""

from __future__ import annotations

import pytest

from kvmesh.libs.controlplane import ConfigError
from kvmesh.policies.cache.sparsify import kept_slots

from .conftest import assert_all_blocks_free, engine_for, run_all
from .test_car_engine import GREEDY, digest, turns

CAR = {"prefill_admission": "car", "cache_policy": "car"}


def sparse_engine(checkpoint, **overrides):
    options = dict(policies=CAR, prefix_cache_cxl=True, prefix_cache_sparsify=True)
    return engine_for(checkpoint, **{**options, **overrides})


def test_the_last_prompt_query_scores_the_prompt_s_tokens(tiny_checkpoint):
    engine = sparse_engine(tiny_checkpoint, sparsify_keep_ratios=[1.0] * 4)
    run_all(engine, turns(1, seed=3, length=64), GREEDY)   # 4 whole blocks: one observation at the prompt's end
    device = engine.blocks.device
    for layer in range(engine.blocks.num_layers):
        blocks = [node.blocks[layer] for node in engine.blocks.cached.values()][:4]
        # One query's attention over its context, averaged over heads: a distribution.
        assert float(device.scores[blocks].sum()) == pytest.approx(1.0, abs=1e-4)
    assert_all_blocks_free(engine)


def test_a_node_moving_to_the_cxl_tier_keeps_each_layer_s_best_scored_tokens(tiny_checkpoint):
    engine = sparse_engine(tiny_checkpoint, sparsify_keep_ratios=[0.5, 0.25] * 2, sparsify_quality_bound=100.0)
    run_all(engine, turns(1, seed=7, length=64), GREEDY)
    blocks = engine.blocks
    device, cxl = blocks.device, blocks.pools["cxl"]
    nodes = list(blocks.cached.values())
    keep = blocks.keep_tokens
    assert keep == [8, 4, 8, 4]
    expected = {n.node_id: [kept_slots(device.scores[b].tolist(), k) for b, k in zip(n.blocks, keep)] for n in nodes}
    kv = {n.node_id: [device.tensor[b][:, slots] for b, slots in zip(n.blocks, expected[n.node_id])] for n in nodes}

    blocks._evict("device", len(nodes))
    assert {n.tier for n in nodes} == {"cxl"} and all(n.sparsified for n in nodes)
    for node in nodes:
        for b, slots, rows in zip(node.blocks, expected[node.node_id], kv[node.node_id]):
            assert cxl.valid[b].nonzero().flatten().tolist() == slots
            assert digest(cxl.tensor[b][:, slots]) == digest(rows)   # every kept byte
    token_bytes = device.shape.bytes // blocks.block_size
    assert blocks.moved_bytes["cxl"] == len(nodes) * sum(keep) * token_bytes   # only the kept slots were copied

    assert blocks.reload(nodes) == len(nodes)
    blocks.flush_loads()
    for node in nodes:
        for b, slots, rows in zip(node.blocks, expected[node.node_id], kv[node.node_id]):
            assert device.valid[b].nonzero().flatten().tolist() == slots and b in device.sparse
            assert digest(device.tensor[b][:, slots]) == digest(rows)
    assert blocks.moved_bytes["device"] == blocks.moved_bytes["cxl"]
    blocks.clear_cache()
    assert not device.sparse and not cxl.sparse and bool(device.valid.all()) and float(device.scores.abs().sum()) == 0
    assert_all_blocks_free(engine)


def interleaved(engine, talks: list[list[list[int]]]) -> list[list[list[int]]]:
    """Conversations taking turns, so each turn pushes the others' nodes out to the cxl tier."""
    answers, history = [[] for _ in talks], [[] for _ in talks]
    for turn in range(len(talks[0])):
        for c, talk in enumerate(talks):
            request = run_all(engine, [history[c] + talk[turn]], GREEDY)[0]
            answers[c].append(request.output_ids)
            history[c] += talk[turn] + request.output_ids
    return answers


def test_keeping_every_token_answers_bit_identically_to_no_sparsification(tiny_checkpoint):
    talks = [turns(3, seed) for seed in range(3)]
    tiers = dict(device_blocks=4 * 24, cxl_blocks=4 * 96)
    dense = engine_for(tiny_checkpoint, policies=CAR, prefix_cache_cxl=True, **tiers)
    whole = sparse_engine(tiny_checkpoint, sparsify_keep_ratios=[1.0] * 4, **tiers)
    assert interleaved(whole, talks) == interleaved(dense, talks)
    assert whole.state().prefix_cache_moved_bytes == dense.state().prefix_cache_moved_bytes
    assert whole.state().prefix_cache_moved_nodes["device"] > 0
    assert_all_blocks_free(whole)


def test_a_conversation_over_sparsified_nodes_moves_fewer_bytes_and_gives_every_block_back(tiny_checkpoint):
    talks = [turns(3, seed) for seed in range(3)]
    tiers = dict(device_blocks=4 * 24, cxl_blocks=4 * 96)
    dense = engine_for(tiny_checkpoint, policies=CAR, prefix_cache_cxl=True, **tiers)
    sparse = sparse_engine(tiny_checkpoint, sparsify_keep_ratios=[0.5] * 4, sparsify_quality_bound=100.0, **tiers)
    answers = interleaved(sparse, talks)
    interleaved(dense, talks)
    assert all(len(a) == GREEDY.max_tokens for talk in answers for a in talk)
    moved, dense_moved = sparse.state(), dense.state()
    assert moved.prefix_cache_moved_nodes["cxl"] > 0 and moved.prefix_cache_moved_nodes["device"] > 0
    per_node = moved.prefix_cache_moved_bytes["device"] / moved.prefix_cache_moved_nodes["device"]
    assert per_node == dense_moved.prefix_cache_moved_bytes["device"] / dense_moved.prefix_cache_moved_nodes["device"] / 2
    assert_all_blocks_free(sparse)


def test_the_profile_picks_ratios_within_the_quality_bound(tiny_checkpoint):
    engine = sparse_engine(tiny_checkpoint, sparsify_quality_bound=0.05)
    profile = engine.state().sparsity_profile
    assert len(profile.sparsity) == len(profile.keep_ratios) == engine.blocks.num_layers
    assert all(0 <= s <= 1 for s in profile.sparsity) and not profile.configured
    assert profile.quality_cost <= profile.quality_bound == 0.05
    assert engine.blocks.keep_tokens == profile.keep_tokens


def test_ratios_whose_quality_cost_passes_the_bound_are_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="refused"):
        sparse_engine(tiny_checkpoint, sparsify_keep_ratios=[0.0625] * 4, sparsify_quality_bound=1e-6)
    with pytest.raises(ConfigError, match="4 layers"):
        sparse_engine(tiny_checkpoint, sparsify_keep_ratios=[0.5])


@pytest.mark.parametrize("overrides,message", [
    (dict(prefix_cache_cxl=False), "needs prefix_cache_cxl"),
    (dict(role="prefill"), "not role prefill"),
])
def test_sparsification_needs_a_cxl_prefix_cache_on_an_engine_that_decodes(tiny_checkpoint, overrides, message):
    with pytest.raises(ConfigError, match=message):
        sparse_engine(tiny_checkpoint, **overrides)


def test_masked_slots_never_reach_the_answer(tiny_checkpoint):
    """Garbage in dropped slots changes nothing: they are masked out of attention."""
    talk = turns(2, seed=11)
    answers = []
    for garbage in (0.0, 1e4):
        engine = sparse_engine(tiny_checkpoint, sparsify_keep_ratios=[0.5] * 4, sparsify_quality_bound=100.0)
        first = run_all(engine, [talk[0]], GREEDY)[0]
        blocks = engine.blocks
        nodes = list(blocks.cached.values())
        blocks._evict("device", len(nodes))
        blocks.reload(nodes)
        blocks.flush_loads()
        device = blocks.device
        for node in nodes:
            for b in node.blocks:
                device.tensor[b][:, ~device.valid[b]] = garbage
        answers.append(run_all(engine, [talk[0] + first.output_ids + talk[1]], GREEDY)[0].output_ids)
        assert blocks.hit_blocks["device"] == len(nodes)
        assert_all_blocks_free(engine)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("policies,moves", [
    # LayerKV offloads layers of requests that reuse nothing, and caches none of theirs: no node moves.
    ({"layer_offload": "keep"}, False),
    # Swapped-out requests carry their sparsified copies' masks to the cxl tier and back.
    ({"preemption_strategy": "swap"}, True),
])
def test_sparsified_nodes_mix_with_layer_offload_and_swapping(tiny_checkpoint, monkeypatch, policies, moves):
    from kvmesh.policies import registry

    from .test_layerkv_engine import STAGE, keep

    monkeypatch.setitem(registry.HOOKS["layer_offload"], "keep", keep(1))
    # Decodes staged, with their layers offloaded: a request whose layers were restored is cached as any.
    engine = sparse_engine(tiny_checkpoint, policies={**CAR, **policies}, sparsify_keep_ratios=[0.5] * 4,
                           sparsify_quality_bound=100.0, device_blocks=4 * 24, cxl_blocks=4 * 96, layer_profile="off",
                           swap_profile="off", token_budget=64, **STAGE)
    talks = [turns(3, seed) for seed in range(4)]
    history = [[] for _ in talks]
    for turn in range(3):   # all conversations at once: the device tier cannot hold them all
        requests = run_all(engine, [history[c] + talk[turn] for c, talk in enumerate(talks)], GREEDY)
        for c, request in enumerate(requests):
            assert len(request.output_ids) == GREEDY.max_tokens
            history[c] += talks[c][turn] + request.output_ids
    state = engine.state()
    assert (state.prefix_cache_moved_nodes["cxl"] > 0) == moves
    assert not moves or sum(state.preemptions.values()) > 0
    assert_all_blocks_free(engine)
