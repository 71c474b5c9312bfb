"""KVMeshScheduler's preemption order inside vLLM: a vLLM engine service whose block pool holds 11
usable blocks, two requests that each grow to 7, so one must give its blocks up. vLLM's own order (the
latest arrival) preempts the second; SRTF (CacheOpt's baseline, by predicted remaining tokens)
preempts the first, predicted to run longer. Both finish in full, and every block comes back."""

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
                    VLLM_CPU_OMP_THREADS_BIND=str(sorted(os.sched_getaffinity(0))[0]), OMP_NUM_THREADS="1")
    try:
        engine.wait_ready(timeout=180)
        yield engine.url
    finally:
        engine.stop()


async def run_two(url: str, order: str) -> tuple[list[str], list[int]]:
    """Switch the preemption order, run the two requests (the first predicted to need 200 tokens, the
    second 20), and return the requests preempted meanwhile and how many tokens each got."""
    async with ServiceClient(url, token=TOKEN, retries=0) as client:
        await client.call("PUT", "/v1/policy", {"policies": {"preemption_order": order}})
        before = (await client.call("GET", "/v1/state", into=dict))["preemptions"]
        started = asyncio.Event()

        async def generate(request_id: str, predicted: int, first: bool) -> int:
            body = {"request_id": request_id, "prompt_token_ids": PROMPT, "max_tokens": 200, "temperature": 0.0,
                    "ignore_eos": True, "predicted_output_len": predicted}
            tokens = 0
            async for frame in client.frames("/v1/generate", body, dict):
                tokens += len(frame["token_ids"])
                if first and tokens:
                    started.set()
            return tokens

        first = asyncio.create_task(generate(f"{order}-first", 200, True))
        await started.wait()
        counts = await asyncio.gather(first, generate(f"{order}-second", 20, False))
        state = await client.call("GET", "/v1/state", into=dict)
    preempted = state["recent_preemptions"][len(state["recent_preemptions"]) - (state["preemptions"] - before):]
    return [vllm_id.rpartition("-")[0] for vllm_id in preempted], list(counts)   # vLLM suffixes our ids


async def test_vllm_preempts_in_the_order_the_policy_gives(squeezed):
    state = await wait_until_idle(squeezed)
    assert state["total_blocks"] == {"device": POOL_BLOCKS - 1}   # vLLM keeps one as its null block
    preempted, counts = await run_two(squeezed, "latest_arrival_first")
    assert counts == [200, 200] and preempted and set(preempted) == {"latest_arrival_first-second"}
    preempted, counts = await run_two(squeezed, "srtf")
    assert counts == [200, 200] and preempted and set(preempted) == {"srtf-first"}
    state = await wait_until_idle(squeezed)
    assert state["free_blocks"] == state["total_blocks"]
