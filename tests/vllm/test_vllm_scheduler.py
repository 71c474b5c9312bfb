"""KVMeshScheduler inside vLLM, on a vLLM engine service whose block pool holds 11 usable blocks.

Preemption order: two requests that each grow to 7 blocks, so one must give its blocks up. vLLM's
own order (the latest arrival) preempts the second; SRTF (CacheOpt's baseline, by predicted
remaining tokens) preempts the first, predicted to run longer.
Allocation (CacheOpt 3.3, the native engine's ledger): by estimate, a request allotted its whole
estimate ahead keeps a second one out instead of being preempted, and one that outruns its estimate
is preempted and comes back with more; CacheOpt grows an underestimated one from the reservation.
Prefill admission: a request decodes behind a TPOT SLO it cannot meet; under LayerKV's admission
(Algorithm 1: its allowance is negative) a second request's prefill waits until it finishes, under
FCFS it starts at once. Every request finishes in full, and every block comes back."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvmesh.infra.local.processes import VLLM_VENV_PYTHON
from kvmesh.libs.controlplane import ServiceClient

from ..conftest import TOKEN
from ..integration.admission_fixtures import launch, wait_until_idle

BLOCK_BYTES = 2 * 4 * 2 * 64 * 32 * 4   # K and V, 4 layers, 2 KV heads of 64, 32 tokens, float32: `tiny`
POOL_BLOCKS = 12
PROMPT = list(range(100, 116))           # 16 tokens; with 200 generated, 216: 7 blocks of 32


@pytest.fixture(scope="module")
def squeezed(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory):
    engine = launch("engine", tmp_path_factory.mktemp("vllm-squeezed"), str(VLLM_VENV_PYTHON),
                    KVMESH_ENGINE_BACKEND="vllm", KVMESH_ENGINE_MODEL=str(vllm_model), KVMESH_ENGINE_BLOCK_SIZE="32",
                    KVMESH_ENGINE_DEVICE_BYTES=str(POOL_BLOCKS * BLOCK_BYTES), KVMESH_ENGINE_MAX_MODEL_LEN="256",
                    KVMESH_ENGINE_PREFIX_CACHING="false", KVMESH_ENGINE_DATAPLANE="none",
                    KVMESH_ENGINE_LAYER_PROFILE="on",   # LayerKV's prefill cost, for the admission test
                    VLLM_CPU_OMP_THREADS_BIND=str(sorted(os.sched_getaffinity(0))[0]), OMP_NUM_THREADS="1")
    try:
        engine.wait_ready(timeout=180)
        yield engine.url
    finally:
        engine.stop()


async def run_two(url: str, label: str, policies: dict[str, str], predicted: tuple[int, int] = (200, 20)
                  ) -> tuple[list[str], list[int], list[dict]]:
    """Switch to `policies`, run the two requests (the first predicted to need `predicted[0]` tokens,
    the second, sent once the first has a token, `predicted[1]`; both make 200), and return the
    requests preempted meanwhile, how many tokens each got and their last frames' timings."""
    async with ServiceClient(url, token=TOKEN, retries=0) as client:
        await client.call("PUT", "/v1/policy", {"policies": {"prefill_admission": "fcfs", **policies}})
        before = (await client.call("GET", "/v1/state", into=dict))["preemptions"]["recompute"]
        started = asyncio.Event()

        async def generate(request_id: str, predicted: int, first: bool) -> tuple[int, dict]:
            body = {"request_id": request_id, "prompt_token_ids": PROMPT, "max_tokens": 200, "temperature": 0.0,
                    "ignore_eos": True, "targets": {"predicted_output_len": predicted}}
            tokens, last = 0, None
            async for frame in client.frames("/v1/generate", body, dict):
                tokens, last = tokens + len(frame["token_ids"]), frame
                if first and tokens:
                    started.set()
            return tokens, last["timings"]

        first = asyncio.create_task(generate(f"{label}-first", predicted[0], True))
        await started.wait()
        results = await asyncio.gather(first, generate(f"{label}-second", predicted[1], False))
        state = await client.call("GET", "/v1/state", into=dict)
    recent, count = state["recent_preemptions"], state["preemptions"]["recompute"] - before
    preempted = recent[len(recent) - count:] if count else []
    return ([vllm_id.rpartition("-")[0] for vllm_id in preempted],   # vLLM suffixes our ids
            [tokens for tokens, _ in results], [timings for _, timings in results])


async def test_vllm_preempts_in_the_order_the_policy_gives(squeezed):
    state = await wait_until_idle(squeezed)
    assert state["total_blocks"] == {"device": POOL_BLOCKS - 1}   # vLLM keeps one as its null block
    assert state["block_size"] == 32
    assert (state["max_num_seqs"], state["token_budget"]) == (64, 2048)   # kvmesh's defaults for a colocated engine
    block = {"kv_allocation": "block_at_a_time"}
    preempted, counts, _ = await run_two(squeezed, "latest", {**block, "preemption_order": "latest_arrival_first"})
    assert counts == [200, 200] and preempted and set(preempted) == {"latest-second"}
    preempted, counts, _ = await run_two(squeezed, "srtf", {**block, "preemption_order": "srtf"})
    assert counts == [200, 200] and preempted and set(preempted) == {"srtf-first"}
    state = await wait_until_idle(squeezed)
    assert state["free_blocks"] == state["total_blocks"]


# -- CacheOpt 3.3: allocation ahead by estimated length, with the global reservation (8 blocks) ---

async def test_allocation_by_estimate_makes_the_second_request_wait_instead_of_preempting(squeezed):
    """Both predicted right (7 blocks each, 11 in all): the first is allotted its 7 ahead, which
    leaves nothing past the reservation for the second, so it waits for the first to finish where
    block allocation (above) let it in and then preempted one of the two."""
    preempted, counts, timings = await run_two(squeezed, "rlp", {"kv_allocation": "estimate",
                                                                 "preemption_order": "latest_arrival_first"},
                                               predicted=(200, 200))
    assert counts == [200, 200] and preempted == []
    assert timings[1]["first_token"] >= timings[0]["finished"]
    state = await wait_until_idle(squeezed)
    assert state["free_blocks"] == state["total_blocks"]
    assert state["unallocated_tokens"] == (POOL_BLOCKS - 1 - 8) * 32   # nobody is allotted anything


async def generate_one(url: str, policies: dict[str, str], body: dict) -> tuple[int, dict]:
    """Under `policies`, one request to its end: the tokens it got and the state's counters that moved."""
    async with ServiceClient(url, token=TOKEN, retries=0) as client:
        await client.call("PUT", "/v1/policy", {"policies": {"prefill_admission": "fcfs", **policies}})
        before = await client.call("GET", "/v1/state", into=dict)
        tokens = 0
        async for frame in client.frames("/v1/generate", {"prompt_token_ids": PROMPT, "temperature": 0.0,
                                                          "ignore_eos": True, **body}, dict):
            tokens += len(frame["token_ids"])
        after = await client.call("GET", "/v1/state", into=dict)
    moved = {"preemptions": after["preemptions"]["recompute"] - before["preemptions"]["recompute"],
             **{f"grown_{source}": n - before["allocations_grown"].get(source, 0)
                for source, n in after["allocations_grown"].items()}}
    return tokens, moved


async def test_rlp_preempts_a_request_that_outruns_its_estimate_and_brings_it_back_with_more(squeezed):
    """Predicted 50 of its 100 tokens: allotted 16 + 50, preempted once its output outruns those 50,
    back with the estimate once more (16 + 100), which sees it through: one preemption."""
    tokens, moved = await generate_one(squeezed, {"kv_allocation": "estimate"},
                                       {"max_tokens": 100, "targets": {"predicted_output_len": 50}})
    assert tokens == 100 and moved["preemptions"] == 1
    state = await wait_until_idle(squeezed)
    assert state["free_blocks"] == state["total_blocks"]


async def test_cacheopt_grows_an_underestimated_request_from_the_reservation_instead_of_preempting(squeezed):
    """Predicted 2 of its 200 tokens (7 blocks): CacheOpt allots what it can past the reservation
    (3 blocks), then grows it from the reservation on demand: no preemption."""
    tokens, moved = await generate_one(squeezed, {"kv_allocation": "cacheopt"},
                                       {"max_tokens": 200, "targets": {"predicted_output_len": 2}})
    assert tokens == 200 and moved["preemptions"] == 0 and moved["grown_reserved"] > 0
    state = await wait_until_idle(squeezed)
    assert state["free_blocks"] == state["total_blocks"]
    assert state["unallocated_tokens"] == (POOL_BLOCKS - 1 - 8) * 32


PAIR_ATTEMPTS = 20
LEFT_AT_ARRIVAL = 10   # of the first's tokens, still to come when the second arrives: a step to admit it, and to spare


async def decode_then_prefill(url: str, admission: str) -> tuple[dict, dict, int]:
    """Under `admission`: a request decoding behind a 1 ms TPOT SLO, and a second one sent once the first
    has 5 tokens; their last frames' timings, and how many prefills the policy held back meanwhile.
    On a loaded machine the client's process can wait for a CPU until the engine has finished the first
    (the engine writes each frame within ms, the client reads them all at once), and a second sent then
    tests no admission: the pair runs again until the engine's token times show that the second arrived
    with LEFT_AT_ARRIVAL of the first's tokens to come."""
    async with ServiceClient(url, token=TOKEN, retries=0) as client:
        await client.call("PUT", "/v1/policy", {"policies": {"prefill_admission": admission,
                                                             "preemption_order": "latest_arrival_first",
                                                             "kv_allocation": "block_at_a_time"}})

        async def generate(body: dict, decoding: asyncio.Event | None = None) -> tuple[dict, list[float]]:
            times, last = [], None
            async for frame in client.frames("/v1/generate", {"prompt_token_ids": PROMPT, "temperature": 0.0,
                                                              "ignore_eos": True, **body}, dict):
                times, last = times + frame["times"], frame
                if decoding is not None and len(times) >= 5:
                    decoding.set()
            assert len(times) == body["max_tokens"]
            return last["timings"], times

        for _ in range(PAIR_ATTEMPTS):
            before = (await client.call("GET", "/v1/state", into=dict))["prefills_held_back"]
            decoding = asyncio.Event()
            behind = {"max_tokens": 100, "targets": {"tbt_slo_ms": 1.0, "predicted_output_low": 100}}
            slow = asyncio.create_task(generate(behind, decoding))
            await decoding.wait()
            second, _ = await generate({"max_tokens": 4})
            first, first_times = await slow
            held = (await client.call("GET", "/v1/state", into=dict))["prefills_held_back"] - before
            if sum(t > second["arrival"] for t in first_times) >= LEFT_AT_ARRIVAL:
                return first, second, held
    pytest.fail(f"in {PAIR_ATTEMPTS} pairs the second request never arrived while the first had "
                f"{LEFT_AT_ARRIVAL} tokens to go")


async def test_layerkv_admission_holds_prefills_while_a_decode_is_behind_its_slo(squeezed):
    state = await wait_until_idle(squeezed)
    assert state["prefill_cost"] is not None
    first, second, held = await decode_then_prefill(squeezed, "fcfs")
    assert second["first_token"] < first["finished"] and held == 0
    first, second, held = await decode_then_prefill(squeezed, "layerkv")
    assert second["first_token"] >= first["finished"] and held > 0
    state = await wait_until_idle(squeezed)
    assert state["free_blocks"] == state["total_blocks"]
