"""CaR's cxl tier on the vLLM backend: a colocated vLLM engine (`prefix_cache_cxl`) whose device is
too small to keep a prompt's blocks cached gets them back from the tier, layer by layer, instead
of computing them, and answers exactly as it did the first time; kvmeta's cache table says the
engine holds the prompt's prefix, for the scheduler's routing."""

from __future__ import annotations

import asyncio
import os
from contextlib import ExitStack

import pytest

from kvmesh.infra.local.processes import VLLM_VENV_PYTHON
from kvmesh.libs.controlplane import ServiceClient
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.nodeid import node_ids

from ..conftest import TOKEN, cluster_name, start_kvmeta
from ..integration.admission_fixtures import launch_engine, wait_until_idle

BLOCK = 32
DEVICE_BLOCKS = 24            # the device: a 380-token prompt takes half of it
CXL_BLOCKS = 64
PROMPT = list(range(100, 300))                      # 6 whole blocks before its last token
FILLERS = [list(range(400, 780)), list(range(800, 1180))]


@pytest.fixture(scope="module")
def engine(vllm_model, tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest):
    run_dir = tmp_path_factory.mktemp("vllm-cxl")
    core = sorted(os.sched_getaffinity(0))[0]
    block_bytes = 2 * BLOCK * 2 * 64 * 4 * 4   # K and V, 2 KV heads of 64, float32, 4 layers
    with ExitStack() as stack:
        kvmeta = start_kvmeta(run_dir, redis_url, cluster_name(request))
        stack.callback(kvmeta.child.stop)
        child = launch_engine(run_dir, kvmeta.url, "vllm-c0", "both", str(VLLM_VENV_PYTHON),
                              KVMESH_ENGINE_BACKEND="vllm",
                              KVMESH_ENGINE_MODEL=str(vllm_model), KVMESH_ENGINE_BLOCK_SIZE=str(BLOCK),
                              KVMESH_ENGINE_DEVICE_BYTES=str(DEVICE_BLOCKS * block_bytes),
                              KVMESH_ENGINE_MAX_MODEL_LEN="512", KVMESH_ENGINE_PREFIX_CACHE_CXL="true",
                              KVMESH_ENGINE_CXL_BLOCKS=str(CXL_BLOCKS), VLLM_CPU_OMP_THREADS_BIND=str(core),
                              OMP_NUM_THREADS="1")
        stack.callback(child.stop)
        child.wait_ready(timeout=180)
        yield child, kvmeta.url


async def generate(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    async with ServiceClient(url, token=TOKEN) as client:
        frames = [f async for f in client.frames("/v1/generate", {"prompt_token_ids": prompt, "max_tokens": max_tokens,
                                                                  "temperature": 0.0, "ignore_eos": True}, dict)]
    return {"token_ids": [t for f in frames for t in f["token_ids"]], "usage": frames[-1]["usage"]}


async def test_a_prompt_the_device_let_go_comes_back_from_the_cxl_tier(engine):
    engine, kvmeta_url = engine
    first = await generate(engine.url, PROMPT)
    assert first["usage"]["cached_tokens"] == 0
    for filler in FILLERS:   # push the prompt's blocks out of vLLM's own prefix cache
        await generate(engine.url, filler)
    state = await wait_until_idle(engine.url)
    # every full block computed was written through: 207 tokens' KV for the prompt, 387 for each filler
    assert state["prefix_cache_nodes"]["cxl"] == 6 + 12 + 12

    again = await generate(engine.url, PROMPT)
    assert again["token_ids"] == first["token_ids"]
    assert again["usage"]["cached_tokens"] == 6 * BLOCK   # none computed: every whole block loaded back
    state = await wait_until_idle(engine.url)
    assert state["prefix_cache_hit_blocks"] == {"cxl": 6}
    assert state["prefix_cache_moved_nodes"]["device"] == 6
    assert state["prefix_cache_moved_bytes"]["device"] == 6 * state["prefix_cache_moved_bytes"]["cxl"] // \
        state["prefix_cache_moved_nodes"]["cxl"] > 0
    assert state["free_blocks"] == state["total_blocks"] == {"device": state["total_blocks"]["device"],
                                                             "cxl": CXL_BLOCKS}

    # the tier's nodes are in kvmeta's cache table under the names the scheduler computes for the prompt
    # (the engine publishes its cache's changes every 0.2 s: a busy machine may take longer)
    names = node_ids(PROMPT, BLOCK, engine.env["KVMESH_ENGINE_MODEL"])
    async with KvmetaClient(kvmeta_url, TOKEN) as kvmeta:
        deadline = asyncio.get_running_loop().time() + 10.0
        while [(m.engine, m.blocks, m.device_blocks) for m in await kvmeta.lookup(names)] != [("vllm-c0", 6, 0)] \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        matches = await kvmeta.lookup(names)
    assert [(m.engine, m.blocks, m.device_blocks) for m in matches] == [("vllm-c0", 6, 0)]


async def test_a_request_vllm_preempts_gets_its_kv_back_from_the_cxl_tier(engine):
    """vLLM only recomputes a preempted request; with the tier, what it had computed is loaded back."""
    engine, _ = engine
    prompts = [list(range(1200, 1400)), list(range(1400, 1600))]   # each grows to 14 of the device's 24 blocks
    alone = [await generate(engine.url, p, max_tokens=250) for p in prompts]
    before = await wait_until_idle(engine.url)
    together = await asyncio.gather(*(generate(engine.url, p, max_tokens=250) for p in prompts))
    state = await wait_until_idle(engine.url)
    assert [a["token_ids"] for a in together] == [a["token_ids"] for a in alone]
    assert state["preemptions"]["recompute"] > before["preemptions"]["recompute"]
    # the victim got back from the tier the blocks vLLM's device cache had given up meanwhile (the rest
    # it found on the device, which vLLM looks in first), rather than computing them again
    assert state["prefix_cache_hit_blocks"]["cxl"] > before["prefix_cache_hit_blocks"]["cxl"]
    assert state["free_blocks"] == state["total_blocks"]
