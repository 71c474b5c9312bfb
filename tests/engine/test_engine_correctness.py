"""The engine's greedy output equals transformers' for the same checkpoint: served concurrently, with
chunked prefill, under preemption by recompute and by swap, and with prefix-cache hits."""

from __future__ import annotations

import random

import pytest


from kvmesh.libs.messages.engine import SamplingParams

from .conftest import assert_all_blocks_free, engine_for, hf_greedy, run_all

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)


def prompts(n: int, seed: int = 0, lengths=(3, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(hf_model):
    cache = {}

    def greedy(prompt: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(hf_model, prompt, GREEDY.max_tokens)
        return cache[key]

    return greedy


def check(requests, reference) -> None:
    for request in requests:
        tokens, logprobs = reference(request.prompt_ids)
        assert request.output_ids == tokens, request.request_id
        assert request.output_logprobs == pytest.approx(logprobs, abs=2e-4)


def test_concurrent_mixed_length_prompts_match_transformers(tiny_checkpoint, reference):
    engine = engine_for(tiny_checkpoint)
    check(run_all(engine, prompts(6), GREEDY), reference)
    assert_all_blocks_free(engine)


def test_chunked_prefill_matches(tiny_checkpoint, reference):
    engine = engine_for(tiny_checkpoint, token_budget=24)
    check(run_all(engine, prompts(4, seed=1, lengths=(40, 90)), GREEDY), reference)
    assert engine.steps > 12 + 90 // 24  # prompts really were split across steps
    assert_all_blocks_free(engine)


def test_token_budget_follows_the_role(tiny_checkpoint):
    """0 (the default) lets the engine pick: vLLM's CPU 2048 where decodes share the steps, 512 on a
    prefill-only engine (factory.token_budget); a set budget stays."""
    assert engine_for(tiny_checkpoint).scheduler.token_budget == 2048
    assert engine_for(tiny_checkpoint, role="prefill").scheduler.token_budget == 512
    assert engine_for(tiny_checkpoint, role="prefill", token_budget=24).scheduler.token_budget == 24


@pytest.mark.parametrize("strategy", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(tiny_checkpoint, reference, strategy):
    # 4 layers x 10 blocks of 16 tokens per request at most: 96 blocks hold only two or three at once.
    engine = engine_for(tiny_checkpoint, device_blocks=96, prefix_caching=False,
                        policies={"preemption_strategy": strategy})
    check(run_all(engine, prompts(6, seed=2, lengths=(30, 60)), GREEDY), reference)
    assert engine.preemptions[strategy] > 0
    assert_all_blocks_free(engine)


def test_swap_to_a_file_backed_cxl_tier(tiny_checkpoint, reference, tmp_path):
    engine = engine_for(tiny_checkpoint, device_blocks=96, cxl_blocks=256, cxl_path=str(tmp_path / "cxl.pool"),
                        prefix_caching=False, policies={"preemption_strategy": "swap"})
    check(run_all(engine, prompts(6, seed=2, lengths=(30, 60)), GREEDY), reference)
    assert engine.preemptions["swap"] > 0
    assert (tmp_path / "cxl.pool").stat().st_size == 256 * engine.blocks.pools["cxl"].shape.bytes
    assert_all_blocks_free(engine)


def test_prefix_cache_hits_match_and_are_counted(tiny_checkpoint, reference):
    engine = engine_for(tiny_checkpoint)
    shared = prompts(1, seed=3, lengths=(48, 48))[0]                # three full blocks
    first = run_all(engine, [shared + [7, 8, 9]], GREEDY)
    again = run_all(engine, [shared + [10, 11], shared + [7, 8, 9], shared], GREEDY)  # the last: fully cached
    check(first + again, reference)
    assert [r.num_cached for r in again] == [48, 48, 47]
    assert_all_blocks_free(engine)


def test_abort_at_every_phase_frees_every_block(tiny_checkpoint):
    from kvmesh.services.engine.native.request import Status

    # 64 blocks = 16 per layer = 256 tokens for everyone; each request grows to ~110 tokens.
    engine = engine_for(tiny_checkpoint, device_blocks=64, token_budget=24, max_num_seqs=4,
                        policies={"preemption_strategy": "swap"})
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    requests = [engine.add(f"r{i}", p, long) for i, p in enumerate(prompts(8, seed=4, lengths=(40, 60)))]
    seen: dict[Status, str] = {}
    for _ in range(400):
        engine.step()
        for request in requests:
            phase = request.status
            if request.status is Status.RUNNING and request.num_computed < len(request.prompt_ids):
                phase = "prefill"
            if phase not in seen and not request.finished:
                seen[phase] = request.request_id
                engine.abort(request.request_id)  # abort one request in each phase it is first seen in
        if not engine.scheduler.has_work():
            break
    assert set(seen) >= {Status.WAITING, "prefill", Status.RUNNING, Status.SWAPPED}
    assert all(r.finished for r in requests)
    assert sum(r.finish_reason == "abort" for r in requests) == len(seen)
    assert_all_blocks_free(engine)
