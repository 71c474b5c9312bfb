"""LayerKV's decodes in the native engine with `decode_offloaded` "restore": a request whose prefill
left layers in the cxl tier gets them back once and decodes from the device. Greedy output is the
engine's own without any offloading, token for token, no decode is staged, and every block of both
tiers comes back."""

from __future__ import annotations

import random

import pytest

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies import registry
from kvmesh.policies.offload import OffloadPlan, decodes_next

from kvmesh.libs.messages.engine import SamplingParams

from .conftest import assert_all_blocks_free, engine_for, run_all
from .test_engine_correctness import GREEDY, prompts


def restoring_engine(tiny_checkpoint, policies=None, **overrides):
    """A LayerKV engine whose Eq. 4 has an unbounded link (x = 0 for every prompt), its decodes restoring."""
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "layerkv", **(policies or {})}, layer_profile="off",
                        layer_decode="restore", **overrides)
    engine.blocks.use_layer_costs(PrefillCost(alpha=1.0, num_params=10**6, hidden_size=256, flops_per_s=1e9),
                                  OffloadCost(beta=1.0, num_layers=4, head_dim=64, num_kv_heads=2, bytes_per_element=4,
                                              bandwidth_bytes_per_s=float("inf")))
    return engine


def test_restored_layers_decode_as_the_engine_without_offloading(tiny_checkpoint):
    # As in test_layerkv_engine: a threshold of 60% of 256 blocks leaves room for every layer of the
    # first two of these prompts; the last two keep none, and wait after their prefill for their layers.
    batch = prompts(4, seed=4)
    plain = engine_for(tiny_checkpoint, prefix_caching=False)
    expected = [(r.output_ids, r.output_logprobs) for r in run_all(plain, batch, GREEDY)]
    engine = restoring_engine(tiny_checkpoint, device_blocks=256, layer_free_threshold=0.6, prefix_caching=False)
    staged = []
    prepare = engine.runner.staging.prepare

    def recording(chunks, tables, area):
        staged.extend(decodes_next(c.request.view()) for c in chunks if c.request.offloaded)
        return prepare(chunks, tables, area)

    engine.runner.staging.prepare = recording
    requests = run_all(engine, batch, GREEDY)
    assert [r.output_ids for r in requests] == [tokens for tokens, _ in expected]
    for request, (_, logprobs) in zip(requests, expected):
        assert request.output_logprobs == pytest.approx(logprobs, abs=1e-5)
    moved = engine.scheduler.layers_offloaded
    assert moved["admitted"] == 2 * 4 and moved["restored"] == moved["admitted"] + moved["forecast"]
    assert staged and not any(staged), "prefills staged, decodes never"
    assert_all_blocks_free(engine)


def test_a_request_waiting_alone_under_cacheopts_ledger_restores_its_layers_and_finishes(tiny_checkpoint):
    # 64 device blocks, 16 a layer; a 180-token prompt takes 12 a layer, its allotment of 200 tokens
    # 13, and the ledger reserves 8 (kv_reserved_blocks). Alone, with a threshold of 60% it keeps no
    # layer; restored, 16 - 12 - 1 = 3 a layer are left, under the reservation: it preempted itself
    # and prefilled again for each of its 20 tokens. Nobody else holds a place: the reservation goes.
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = prompts(1, seed=7, lengths=(180, 180))
    plain = run_all(engine_for(tiny_checkpoint, prefix_caching=False), prompt, params)
    engine = restoring_engine(tiny_checkpoint, {"kv_allocation": "cacheopt"}, device_blocks=64, cxl_blocks=256,
                              layer_free_threshold=0.6, prefix_caching=False)
    [request] = run_all(engine, prompt, params)
    assert request.output_ids == plain[0].output_ids and request.preemptions == 0
    assert engine.scheduler.layers_offloaded == {"admitted": 4, "forecast": 0, "restored": 4}
    assert_all_blocks_free(engine)


def test_a_request_alone_whose_cached_prefix_holds_the_room_decodes_staged_not_preempted(tiny_checkpoint, monkeypatch):
    """A forecast that takes every layer of a prefilling request once 128 tokens are computed: the 8
    blocks a layer it committed to the prefix cache stay held on the device (32 of 64), and all 4 of
    its layers back at 200 tokens take 52 more. Alone, it preempted itself and came back to the same
    wait; now its decodes are staged, and every block of both tiers comes back."""
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "late", lambda inp: OffloadPlan(shrink={
        r.request_id: 0 for r in inp.running if not decodes_next(r) and r.num_computed >= 128 and r.device_layers == 4}))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = prompts(1, seed=8, lengths=(200, 200))
    plain = run_all(engine_for(tiny_checkpoint, prefix_caching=False), prompt, params)
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "late"}, layer_profile="off", device_blocks=64,
                        cxl_blocks=256, token_budget=64)
    [request] = run_all(engine, prompt, params)
    assert request.output_ids == plain[0].output_ids and request.preemptions == 0
    assert engine.scheduler.layers_offloaded == {"admitted": 0, "forecast": 4, "restored": 0}
    assert_all_blocks_free(engine)


def test_a_prefill_with_no_staging_room_leaves_the_budget_to_the_decode_behind_it(tiny_checkpoint):
    # 64 device blocks (16 a layer), budget 32, threshold 50%: a's 220-token prompt keeps every layer
    # while b (120 tokens, arriving a step later) is admitted with none, and once a decodes, b's next
    # chunk finds no staging room. b goes first, and took the whole budget: a got no step, nothing
    # ran, b was preempted (its prefill lost) and came back: 8 preemptions. Now b's chunk waits
    # without budget and a decodes every step.
    rng = random.Random(1)
    a_prompt, b_prompt = ([rng.randrange(3, 2000) for _ in range(n)] for n in (220, 120))
    a_params, b_params = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 4))
    plain = engine_for(tiny_checkpoint, prefix_caching=False)
    expected = [r.output_ids for r in run_all(plain, [a_prompt, b_prompt], a_params)]
    engine = restoring_engine(tiny_checkpoint, device_blocks=64, cxl_blocks=256, layer_free_threshold=0.5,
                              token_budget=32)
    a = engine.add("a", a_prompt, a_params)
    engine.step()
    b = engine.add("b", b_prompt, b_params)
    while engine.scheduler.has_work():
        engine.step()
    assert sum(engine.preemptions.values()) == 0
    assert a.output_ids == expected[0] and b.output_ids == expected[1][:4]
    assert_all_blocks_free(engine)
