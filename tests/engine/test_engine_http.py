"""The engine service as a process on loopback: streamed generation, abort, state, policy, bad input."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from kvmesh.infra.local.processes import Child, free_port, service_child
from kvmesh.libs.controlplane import RemoteError, ServiceClient
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.messages.engine import Frame
from kvmesh.services.engine.state import EngineState

from ..conftest import TOKEN, Kvmeta
from ..polling import eventually

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def launch_engine(run_dir: Path, checkpoint: Path, **env: str) -> Child:
    """An engine process serving `checkpoint`, started and not yet waited on."""
    port = free_port()
    child = service_child("engine", run_dir, f"http://127.0.0.1:{port}", {
        "KVMESH_ENGINE_PORT": str(port), "KVMESH_ENGINE_MODEL": str(checkpoint), "KVMESH_TOKEN": TOKEN,
        "KVMESH_ENGINE_TORCH_THREADS": "1", **env})
    child.start()
    return child


def start_engine(run_dir: Path, checkpoint: Path, **env: str) -> Child:
    child = launch_engine(run_dir, checkpoint, **env)
    child.wait_ready(timeout=120)
    return child


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    child = start_engine(tmp_path_factory.mktemp("engine"), tiny_checkpoint)
    yield child
    child.stop()


@pytest.fixture
async def client(engine: Child):
    async with ServiceClient(engine.url, token=TOKEN) as c:
        yield c
    # Every test ends with the engine's blocks all free. Idle three polls in a row: a request the
    # engine thread has not taken yet (a client that hung up right after sending) is not in a state
    # published before it, so one idle answer can come too early.
    async with ServiceClient(engine.url, token=TOKEN) as c:
        idle = 0
        for _ in range(100):
            state = await c.call("GET", "/v1/state", into=EngineState)
            idle = idle + 1 if state.free_blocks == state.total_blocks and not state.running and not state.waiting else 0
            if idle == 3:
                break
            await asyncio.sleep(0.05)
        assert state.free_blocks == state.total_blocks


async def generate(client: ServiceClient, **body) -> list[Frame]:
    return [frame async for frame in client.frames("/v1/generate", body, Frame)]


async def test_generate_streams_one_frame_per_token_with_usage(client):
    frames = await generate(client, prompt="The cache holds", max_tokens=6, temperature=0.0, ignore_eos=True,
                            logprobs=True)
    assert len(frames) == 6 and all(len(f.token_ids) == 1 and len(f.times) == 1 for f in frames)
    assert [f.finish_reason for f in frames] == [None] * 5 + ["length"]
    assert frames[-1].usage.completion_tokens == 6 and frames[-1].usage.prompt_tokens > 0
    assert all(f.logprobs[0] <= 0 for f in frames)
    assert frames[0].times[0] <= frames[-1].times[0]


async def test_greedy_is_deterministic_and_seeds_reproduce(client):
    greedy = [await generate(client, prompt_token_ids=[5, 6, 7], max_tokens=5, temperature=0.0, ignore_eos=True)
              for _ in range(2)]
    assert [f.token_ids for f in greedy[0]] == [f.token_ids for f in greedy[1]]
    seeded = [await generate(client, prompt_token_ids=[5, 6, 7], max_tokens=8, seed=11, ignore_eos=True)
              for _ in range(2)]
    assert [f.token_ids for f in seeded[0]] == [f.token_ids for f in seeded[1]]


async def test_json_lines_for_curl(engine: Child, client):
    async with aiohttp.ClientSession() as http:
        async with http.post(engine.url + "/v1/generate", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                             headers={**AUTH, "Accept": "application/json"}) as response:
            lines = (await response.read()).splitlines()
    assert response.content_type == "application/x-ndjson" and len(lines) == 3
    assert msgspec.json.decode(lines[-1])["finish_reason"] == "length"


async def test_abort_ends_the_stream_and_frees_blocks(client):
    frames: list[Frame] = []
    async for frame in client.frames("/v1/generate", {"request_id": "long-one", "prompt_token_ids": list(range(3, 40)),
                                                      "max_tokens": 400, "ignore_eos": True}, Frame):
        if not frames:   # the request runs: its first frame is here
            aborted = await client.call("POST", "/v1/abort", {"request_id": "long-one"}, into=dict)
        frames.append(frame)
    tokens = sum(len(f.token_ids) for f in frames)
    assert aborted == {"aborted": True} and frames[-1].finish_reason == "abort" and tokens < 400
    assert await client.call("POST", "/v1/abort", {"request_id": "long-one"}, into=dict) == {"aborted": False}


async def test_client_disconnect_frees_blocks(engine: Child, client):
    async with aiohttp.ClientSession() as http:
        for _ in range(5):
            async with http.post(engine.url + "/v1/generate", headers=AUTH,
                                 json={"prompt_token_ids": list(range(3, 30)), "max_tokens": 300,
                                       "ignore_eos": True}) as response:
                await response.content.read(10)  # a frame or so, then hang up
    # The fixture checks that every block came back.


@pytest.mark.parametrize("body, message", [
    ({"prompt": ""}, "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({}, "exactly one"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt_token_ids": [1, 10**9]}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 5000}, "context limit"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "best_of": 3}, "unknown field"),
    ({"prompt": "a", "max_tokens": "many"}, "Expected `int`"),
    ({"prompt": "a", "targets": {"tbt_slo_ms": 0}}, "tbt_slo_ms must be a positive number"),
    ({"prompt": "a", "targets": {"ttft_slo_ms": -5.0}}, "ttft_slo_ms must be a positive number"),
    ({"prompt": "a", "targets": {"tbt_slo_ms": "soon"}}, "Expected `float"),
    ({"prompt": "a", "targets": {"predicted_output_len": 0}}, "predicted_output_len must be at least 1"),
    ({"prompt": "a", "targets": {"predicted_output_len": 2.5}}, "Expected `int"),
    ({"prompt": "a", "targets": {"predicted_output_low": 0}}, "predicted_output_low must be at least 1"),
    ({"prompt": "a", "targets": {"predicted_output_low": 9, "predicted_output_median": 4}},
     "is above predicted_output_median"),
    ({"prompt": "a", "targets": {"deadline_ms": 5}}, "unknown field"),
    ({"prompt": "a", "ttft_slo_ms": 500}, "unknown field"),  # the targets go under `targets` only
    ({"prompt": "a", "kv_source": {"engine": "p", "data_address": "x:1", "request_id": "r", "num_tokens": 1,
                                   "block_size": 16, "layers": [[0]] * 4, "tiers": ["gpu"] * 4}}, "tiers"),
])
async def test_bad_input_is_400_with_a_reason(engine: Child, client, body, message):
    async with aiohttp.ClientSession() as http:
        async with http.post(engine.url + "/v1/generate", json=body, headers=AUTH) as response:
            error = (await response.json())["error"]
    assert response.status == 400 and message in error["message"]
    state = await client.call("GET", "/v1/state", into=EngineState)
    assert state.waiting == state.running == 0


HANDLE = {"engine": "p", "data_address": "x:1", "request_id": "r", "num_tokens": 1, "block_size": 16,
          "layers": [[0]] * 4}


@pytest.mark.parametrize("path, body, message", [
    ("/v1/prefill", {"prompt": "a", "kv_source": HANDLE}, "kv_source (KV to load) belongs on /v1/decode"),
    ("/v1/prefill", {"prompt": "a", "max_tokens": 4}, "max_tokens 1"),
    ("/v1/decode", {"prompt": "a b"}, "missing required field `kv_source`"),
    ("/v1/decode", {"prompt": "a b", "kv_source": HANDLE, "kv_transfer": {}}, "belongs on /v1/prefill"),
])
async def test_each_phase_has_its_own_route_and_refuses_the_others_fields(engine: Child, client, path, body, message):
    async with aiohttp.ClientSession() as http:
        async with http.post(engine.url + path, json=body, headers=AUTH) as response:
            error = (await response.json())["error"]
    assert response.status == 400 and message in error["message"]
    state = await client.call("GET", "/v1/state", into=EngineState)
    assert state.waiting == state.running == 0


async def test_policies_switch_at_run_time_and_unknown_ones_are_refused(client):
    names = await client.call("PUT", "/v1/policy", {"policies": {"preemption_strategy": "swap"}}, into=dict)
    assert names["policies"]["preemption_strategy"] == "swap"
    with pytest.raises(RemoteError) as unknown:
        await client.call("PUT", "/v1/policy", {"policies": {"preemption_strategy": "teleport"}})
    assert unknown.value.status == 400 and "teleport" in unknown.value.message
    await client.call("PUT", "/v1/policy", {"policies": {"preemption_strategy": "recompute"}})


async def test_layer_offload_switches_on_at_run_time_and_keeps_greedy_output(client):
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    before = await generate(client, **prompt)
    names = await client.call("PUT", "/v1/policy", {"policies": {"layer_offload": "layerkv"}}, into=dict)
    assert names["policies"]["layer_offload"] == "layerkv"
    try:
        after = await generate(client, **prompt)
    finally:
        await client.call("PUT", "/v1/policy", {"policies": {"layer_offload": "none"}})
    assert [f.token_ids for f in after] == [f.token_ids for f in before]


async def test_state_says_how_many_tokens_a_block_holds_and_the_engine_s_limits(tiny_checkpoint: Path, tmp_path: Path):
    """The blocks /v1/state counts are the engine's configured size, and it says its sequence limit
    and token budget (bench sim prices its KV in those blocks and runs its simulated engines so)."""
    child = start_engine(tmp_path, tiny_checkpoint, KVMESH_ENGINE_BLOCK_SIZE="32", KVMESH_ENGINE_MAX_NUM_SEQS="7",
                         KVMESH_ENGINE_TOKEN_BUDGET="96")
    try:
        async with ServiceClient(child.url, token=TOKEN) as client:
            state = await client.call("GET", "/v1/state", into=EngineState)
        assert state.block_size == 32 and state.total_blocks["device"] > 0
        assert (state.max_num_seqs, state.token_budget) == (7, 96)
    finally:
        child.stop()


async def test_layer_offload_needs_a_cxl_tier(tiny_checkpoint: Path, tmp_path: Path):
    child = start_engine(tmp_path, tiny_checkpoint, KVMESH_ENGINE_CXL_BYTES="0")
    try:
        async with ServiceClient(child.url, token=TOKEN) as client:
            with pytest.raises(RemoteError) as refused:
                await client.call("PUT", "/v1/policy", {"policies": {"layer_offload": "layerkv"}})
            assert refused.value.status == 400 and "cxl tier" in refused.value.message
            names = await client.call("PUT", "/v1/policy", {"policies": {"prefill_admission": "layerkv"}}, into=dict)
            assert names["policies"]["layer_offload"] == "none" and names["policies"]["prefill_admission"] == "layerkv"
    finally:
        child.stop()


async def test_engine_registers_with_kvmeta_and_reports_its_load(kvmeta: Kvmeta, tiny_checkpoint: Path,
                                                                 tmp_path: Path):
    child = start_engine(tmp_path, tiny_checkpoint, KVMESH_KVMETA_URL=kvmeta.url, KVMESH_CLUSTER=kvmeta.cluster,
                         KVMESH_ENGINE_ENGINE_ID="engine-7", KVMESH_ENGINE_HEARTBEAT_TTL_MS="600")
    try:
        async with KvmetaClient(kvmeta.url, TOKEN) as registry:
            for _ in range(40):
                workers = await registry.workers()
                if workers and workers[0].load.free_blocks:
                    break
                await asyncio.sleep(0.1)
            worker = workers[0]
            assert worker.info.id == "engine-7" and worker.info.role == "both"
            assert worker.info.geometry.num_layers == 4 and worker.load.free_blocks["device"] > 0
    finally:
        child.stop()
    async with KvmetaClient(kvmeta.url, TOKEN) as registry:
        assert await registry.workers() == []  # deregistered on the way out


async def test_shutdown_ends_open_streams_with_abort(tiny_checkpoint: Path, tmp_path: Path):
    child = start_engine(tmp_path, tiny_checkpoint)
    try:
        async with ServiceClient(child.url, token=TOKEN) as client:
            frames: list[Frame] = []
            async for frame in client.frames("/v1/generate", {"prompt_token_ids": [5, 6, 7], "max_tokens": 2000,
                                                              "ignore_eos": True}, Frame):
                if not frames:
                    child.process.terminate()   # the stream is open: its first frame is here
                frames.append(frame)
        assert frames[-1].finish_reason == "abort"
        assert child.process.wait(10) == 0
    finally:
        child.stop()


async def test_tokenizer_spec_rebuilds_the_engines_tokenizer(client):
    from tokenizers import Tokenizer

    from kvmesh.libs.messages.engine import TokenizerSpec

    spec = await client.call("GET", "/v1/tokenizer", into=TokenizerSpec)
    rebuilt = Tokenizer.from_str(spec.tokenizer_json)
    frames = await generate(client, prompt="The cache holds", max_tokens=1, temperature=0.0)
    assert frames[-1].usage.prompt_tokens == len(rebuilt.encode("The cache holds").ids)  # with BOS, as the engine encodes
    assert spec.eos_token_ids and spec.max_model_len > 0 and "eos_token" in spec.special_tokens


async def test_the_cache_table_lists_car_s_fields_and_refuses_bad_queries(client):
    await generate(client, prompt_token_ids=list(range(10, 74)), max_tokens=2, temperature=0.0)
    table = await client.call("GET", "/v1/cache", params={"tier": "device", "limit": 2}, into=dict)
    assert len(table["entries"]) == 2 and table["total"]["device"] >= 4
    entry = table["entries"][0]
    assert entry["tier"] == "device" and entry["valid_in_gpu"] and entry["refs"] == 0 and len(entry["blocks"]) == 4
    assert entry["size_bytes"] > 0 and entry["score"] == 0   # its request has ended
    for params in ({"tier": "gpu"}, {"limit": 0}, {"limit": "many"}):
        with pytest.raises(RemoteError) as refused:
            await client.call("GET", "/v1/cache", params=params)
        assert refused.value.status == 400


async def test_the_engine_publishes_its_prefix_cache_to_kvmeta(kvmeta: Kvmeta, tiny_checkpoint: Path, tmp_path: Path):
    """What the engine caches and moves to the cxl tier shows in kvmeta's cache table, where the
    scheduler's prefix-aware routing looks (a device tier of 8 blocks a layer: the second prompt's
    7 blocks push 3 of the first one's 4 nodes out to the cxl tier)."""
    child = start_engine(tmp_path, tiny_checkpoint, KVMESH_KVMETA_URL=kvmeta.url, KVMESH_CLUSTER=kvmeta.cluster,
                         KVMESH_ENGINE_ENGINE_ID="engine-c", KVMESH_ENGINE_DEVICE_BLOCKS="32",
                         KVMESH_ENGINE_PREFIX_CACHE_CXL="true")
    first, second = list(range(10, 74)), list(range(100, 196))   # 4 and 6 full blocks
    ids = node_ids(first, 16, str(tiny_checkpoint), None)
    try:
        async with ServiceClient(child.url, token=TOKEN) as engine, KvmetaClient(kvmeta.url, TOKEN) as registry:
            await generate(engine, prompt_token_ids=first, max_tokens=1, temperature=0.0)
            match = await eventually(lambda: registry.lookup(ids), lambda m: m and m[0].device_blocks == 4, timeout=5)
            assert match[0].engine == "engine-c" and match[0].blocks == 4
            await generate(engine, prompt_token_ids=second, max_tokens=1, temperature=0.0)
            match = await eventually(lambda: registry.lookup(ids), lambda m: m and m[0].device_blocks == 1, timeout=5)
            assert match[0].blocks == 4   # all still cached here, 3 in the cxl tier
            table = await engine.call("GET", "/v1/cache", params={"tier": "cxl"}, into=dict)
            assert len(table["entries"]) == 3 and not table["entries"][0]["valid_in_gpu"]
            # the state is published between steps: after the last one, soon
            await eventually(lambda: engine.call("GET", "/v1/state", into=EngineState),
                             lambda state: state.free_blocks == state.total_blocks, timeout=5)
    finally:
        child.stop()
