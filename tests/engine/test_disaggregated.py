"""Prefill and decode on different engine processes, KV pulled over the data plane (KVDirect):
the strongest check that every byte arrived where it belongs is that greedy output equals the
colocated engine's, token for token."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from kvmesh.infra.local.processes import Child
from kvmesh.libs.controlplane import RemoteError, ServiceClient
from kvmesh.services.engine.state import EngineState

from ..conftest import TOKEN
from ..polling import eventually
from .conftest import loop_failures
from .test_engine_http import generate, launch_engine

PROMPTS = [[5, 6, 7], list(range(10, 60)), list(range(100, 137)), [3] * 16, list(range(200, 290))]


@pytest.fixture(scope="module", params=["tcp", "shm"])
def cluster(request, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp(f"disagg-{request.param}")
    # float32: the tests compare greedy text across engines whose batches differ, and in bf16 a row's
    # rounding depends on the batch it is in (16 concurrent prompts on random weights flipped a near-tie)
    common = {"KVMESH_ENGINE_DATAPLANE": request.param, "KVMESH_ENGINE_KV_TIMEOUT_MS": "3000",
              "KVMESH_ENGINE_KV_LEASE_MS": "1500", "KVMESH_ENGINE_DTYPE": "float32"}
    engines = {  # started together, then waited on: their start-ups overlap
        "both": launch_engine(run_dir / "both", tiny_checkpoint, KVMESH_ENGINE_ENGINE_ID="c0", **common),
        "prefill": launch_engine(run_dir / "prefill", tiny_checkpoint, KVMESH_ENGINE_ROLE="prefill",
                                 KVMESH_ENGINE_ENGINE_ID="p0", **common),
        "decode": launch_engine(run_dir / "decode", tiny_checkpoint, KVMESH_ENGINE_ROLE="decode",
                                KVMESH_ENGINE_ENGINE_ID="d0", KVMESH_ENGINE_DEVICE_BLOCKS="320", **common),
        # LayerKV: on a CPU a copy to the cxl tier hides under any prefill (Eq. 4 gives x = 0), and the
        # whole device tier as the threshold leaves no room to keep a layer there, so the prompts'
        # KV is held in the cxl tier and the decode engine pulls it from there.
        "prefill_layerkv": launch_engine(run_dir / "prefill-layerkv", tiny_checkpoint, KVMESH_ENGINE_ROLE="prefill",
                                         KVMESH_ENGINE_ENGINE_ID="p1", KVMESH_ENGINE_LAYER_FREE_THRESHOLD="1",
                                         KVMESH_ENGINE_POLICIES='{"layer_offload": "layerkv"}', **common),
    }
    try:
        for child in engines.values():
            child.wait_ready(timeout=120)
        yield engines
    finally:
        for child in engines.values():
            child.stop()
    assert {name: loop_failures(child.log_path) for name, child in engines.items()} == {name: [] for name in engines}


@pytest.fixture
async def clients(cluster: dict[str, Child]):
    async with ServiceClient(cluster["both"].url, token=TOKEN) as both, \
            ServiceClient(cluster["prefill"].url, token=TOKEN) as prefill, \
            ServiceClient(cluster["decode"].url, token=TOKEN) as decode, \
            ServiceClient(cluster["prefill_layerkv"].url, token=TOKEN) as prefill_layerkv:
        yield {"both": both, "prefill": prefill, "decode": decode, "prefill_layerkv": prefill_layerkv}
        for client in (both, prefill, decode, prefill_layerkv):  # every test ends with every block free, nothing held
            await until_idle(client)


async def until_idle(client: ServiceClient, timeout: float = 10.0) -> EngineState:
    """Every block free, nothing running, waiting, pulling, held or pushing."""
    return await eventually(lambda: client.call("GET", "/v1/state", into=EngineState), timeout=timeout, interval=0.05,
                            until=lambda s: s.free_blocks == s.total_blocks
                            and not (s.running or s.waiting or s.pulling or s.held_kv or s.pushing))


async def disaggregated(clients, prompt: list[int], max_tokens: int, request_id: str, prefill: str = "prefill",
                        tiers: set[str] | None = None) -> list[int]:
    first = await generate(clients[prefill], request_id=request_id, prompt_token_ids=prompt, max_tokens=1,
                           temperature=0.0, ignore_eos=True, kv_transfer={"mode": "pull"})
    handle = first[-1].kv_handle
    assert handle is not None and handle.num_tokens == len(prompt)
    assert tiers is None or set(handle.tiers or ["device"]) == tiers
    rest = await generate(clients["decode"], request_id=request_id, prompt_token_ids=prompt + first[-1].token_ids,
                          max_tokens=max_tokens - 1, temperature=0.0, ignore_eos=True, kv_source=msgspec_dict(handle))
    return first[-1].token_ids + [t for frame in rest for t in frame.token_ids]


def msgspec_dict(struct) -> dict:
    import msgspec

    return msgspec.to_builtins(struct)


async def colocated(clients, prompt: list[int], max_tokens: int) -> list[int]:
    frames = await generate(clients["both"], prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True)
    return [t for frame in frames for t in frame.token_ids]


async def test_disaggregated_greedy_equals_colocated_for_concurrent_prompts(clients):
    expected = await asyncio.gather(*(colocated(clients, p, 12) for p in PROMPTS))
    got = await asyncio.gather(*(disaggregated(clients, p, 12, f"r{i}") for i, p in enumerate(PROMPTS)))
    assert got == expected


async def test_kv_a_prefill_engine_holds_in_its_cxl_tier_is_pulled_from_there(clients):
    """LayerKV on the prefill side: the handle names each layer's tier and the pull reads both regions."""
    expected = await asyncio.gather(*(colocated(clients, p, 12) for p in PROMPTS))
    got = await asyncio.gather(*(disaggregated(clients, p, 12, f"l{i}", prefill="prefill_layerkv", tiers={"cxl"})
                                 for i, p in enumerate(PROMPTS)))
    assert got == expected
    state = await clients["prefill_layerkv"].call("GET", "/v1/state", into=EngineState)
    assert state.layers_offloaded["admitted"] == 4 * len(PROMPTS)


async def test_more_requests_than_the_decode_pool_holds_wait_for_blocks_and_all_finish(clients):
    # 320 blocks over 4 layers is 80 blocks a layer: six 90-token prompts (6 blocks each + growth)
    # fit about ten at once, so with 16 the allocation policy makes some wait.
    prompts = [list(range(300 + i, 390 + i)) for i in range(16)]
    expected = await asyncio.gather(*(colocated(clients, p, 24) for p in prompts))
    got = await asyncio.gather(*(disaggregated(clients, p, 24, f"q{i}") for i, p in enumerate(prompts)))
    assert got == expected


async def test_held_kv_nobody_pulls_is_freed_when_its_lease_runs_out(clients):
    frames = await generate(clients["prefill"], request_id="orphan", prompt_token_ids=list(range(40)), max_tokens=1,
                            temperature=0.0, kv_transfer={"mode": "pull"})
    assert frames[-1].kv_handle is not None
    state = await clients["prefill"].call("GET", "/v1/state", into=EngineState)
    assert state.held_kv == 1 and state.free_blocks != state.total_blocks
    await until_idle(clients["prefill"], timeout=5)  # the 1.5 s lease frees it


async def test_abort_frees_held_kv(clients):
    await generate(clients["prefill"], request_id="dropped", prompt_token_ids=list(range(40)), max_tokens=1,
                   temperature=0.0, kv_transfer={"mode": "pull"})
    aborted = await clients["prefill"].call("POST", "/v1/abort", {"request_id": "dropped"}, into=dict)
    assert aborted["aborted"] is True
    await until_idle(clients["prefill"], timeout=1)


@pytest.mark.parametrize("role, body, message", [
    ("prefill", {"max_tokens": 2, "kv_transfer": {"mode": "pull"}}, "max_tokens 1"),
    ("decode", {"max_tokens": 1, "kv_transfer": {"mode": "pull"}}, "does not hand off"),
    ("prefill", {"kv_source": {"engine": "p0", "data_address": "127.0.0.1:1", "request_id": "x", "num_tokens": 3,
                               "block_size": 16, "layers": [[0]] * 4}}, "does not pull"),
    ("decode", {"kv_source": {"engine": "p0", "data_address": "127.0.0.1:1", "request_id": "x", "num_tokens": 3,
                              "block_size": 16, "layers": [[0]] * 3}}, "do not fit"),
    ("decode", {"kv_source": {"engine": "p0", "data_address": "127.0.0.1:1", "request_id": "x", "num_tokens": 2,
                              "block_size": 16, "layers": [[0]] * 4}}, "must have KV there"),
    ("decode", {"kv_source": {"engine": "p0", "data_address": "127.0.0.1:1", "request_id": "x", "num_tokens": 3,
                              "block_size": 16, "layers": [[]] * 4}}, "needs 1 blocks"),
    ("decode", {"kv_source": {"engine": "p0", "data_address": "127.0.0.1:1", "request_id": "x", "num_tokens": 3,
                              "block_size": 16, "layers": [[0]] * 4, "tiers": ["cxl"] * 3}}, "3 tiers for 4 layers"),
])
async def test_bad_handoffs_are_400_and_change_nothing(clients, role, body, message):
    with pytest.raises(RemoteError) as error:
        await generate(clients[role], prompt_token_ids=[1, 2, 3, 4], **body)
    assert error.value.status == 400 and message in error.value.message


async def test_decode_from_a_vanished_prefill_engine_ends_with_an_error_and_frees_its_blocks(clients):
    frames = await generate(clients["decode"], prompt_token_ids=list(range(20)), max_tokens=4, temperature=0.0,
                            kv_source={"engine": "gone", "data_address": "127.0.0.1:9", "request_id": "lost",
                                       "num_tokens": 19, "block_size": 16, "layers": [[0, 1]] * 4})
    assert frames[-1].finish_reason == "error"


async def test_last_frames_carry_where_the_time_went(clients):
    prompt = list(range(30, 70))
    first = await generate(clients["prefill"], request_id="timed", prompt_token_ids=prompt, max_tokens=1,
                           temperature=0.0, ignore_eos=True, kv_transfer={"mode": "pull"})
    rest = await generate(clients["decode"], request_id="timed", prompt_token_ids=prompt + first[-1].token_ids,
                          max_tokens=3, temperature=0.0, ignore_eos=True, kv_source=msgspec_dict(first[-1].kv_handle))
    prefill, decode = first[-1].timings, rest[-1].timings
    assert prefill.arrival <= prefill.scheduled <= prefill.first_token <= prefill.finished
    assert prefill.pull_start is None
    assert decode.arrival <= decode.scheduled <= decode.pull_start <= decode.pull_end <= decode.first_token <= decode.finished
    assert all(f.timings is None for f in rest[:-1])


async def pushed(clients, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:
    target = await clients["decode"].call("POST", "/v1/kv/reserve", {"request_id": request_id, "num_tokens": len(prompt)},
                                          into=dict)
    first = await generate(clients["prefill"], request_id=request_id, prompt_token_ids=prompt, max_tokens=1,
                           temperature=0.0, ignore_eos=True, kv_transfer={"mode": "push", "target": target})
    assert first[-1].kv_handle is None  # written already: nothing is held for anyone
    rest = await generate(clients["decode"], request_id=request_id, prompt_token_ids=prompt + first[-1].token_ids,
                          max_tokens=max_tokens - 1, temperature=0.0, ignore_eos=True, kv_source=target)
    return first[-1].token_ids + [t for frame in rest for t in frame.token_ids]


async def test_push_mode_greedy_equals_colocated_for_concurrent_prompts(clients):
    expected = await asyncio.gather(*(colocated(clients, p, 12) for p in PROMPTS))
    got = await asyncio.gather(*(pushed(clients, p, 12, f"push{i}") for i, p in enumerate(PROMPTS)))
    assert got == expected


async def test_a_request_whose_writes_are_landing_shows_in_state_as_pushing(cluster, clients):
    """Push mode: the prefill engine has sampled the first token and keeps the blocks until the writes
    land; while the decode engine is stopped (SIGSTOP), they cannot, and /v1/state says who holds them."""
    if cluster["decode"].env["KVMESH_ENGINE_DATAPLANE"] == "shm":
        pytest.skip("shm's writer copies into the decode engine's pool itself: a stopped decode engine holds nothing up")
    await pushed(clients, PROMPTS[0], 2, "push-connects")  # the data-plane connection, made while the peer answers
    target = await clients["decode"].call("POST", "/v1/kv/reserve", {"request_id": "landing", "num_tokens": 50},
                                          into=dict)
    os.kill(cluster["decode"].pid, signal.SIGSTOP)
    try:
        first = asyncio.ensure_future(generate(clients["prefill"], request_id="landing", prompt_token_ids=PROMPTS[1],
                                               max_tokens=1, temperature=0.0, ignore_eos=True,
                                               kv_transfer={"mode": "push", "target": target}))
        state = await eventually(lambda: clients["prefill"].call("GET", "/v1/state", into=EngineState),
                                 until=lambda s: s.pushing == 1, interval=0.05)
        assert state.free_blocks != state.total_blocks and not (state.running or state.held_kv)
    finally:
        os.kill(cluster["decode"].pid, signal.SIGCONT)
    await asyncio.wait_for(first, 10)  # the writes landed, or failed at the KV timeout: either way it ended
    await until_idle(clients["prefill"])


async def test_a_reservation_nobody_claims_is_freed_after_its_lease(clients):
    await clients["decode"].call("POST", "/v1/kv/reserve", {"request_id": "unclaimed", "num_tokens": 40}, into=dict)
    state = await clients["decode"].call("GET", "/v1/state", into=EngineState)
    assert state.pulling == 1 and state.free_blocks != state.total_blocks
    with pytest.raises(RemoteError) as error:  # a claim that does not match the reservation changes nothing
        await generate(clients["decode"], request_id="unclaimed", prompt_token_ids=list(range(10)), max_tokens=2,
                       kv_source={"engine": "d0", "data_address": "x:1", "request_id": "unclaimed", "num_tokens": 9,
                                  "block_size": 16, "layers": [[0]] * 4})
    assert error.value.status == 400 and "no reservation" in error.value.message
    await until_idle(clients["decode"], timeout=5)  # the 1.5 s lease frees it
