"""Push mode on pd:1:1 engine processes with a prompt the prefill engine computes in two chunks: each
chunk's step writes its blocks into the decode engine's reservation (the step records say how many
bytes), the first token goes out once they have landed, and the text is pull mode's, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.libs.controlplane import ServiceClient
from kvmesh.services.engine.steps import EngineSteps

from ..conftest import TOKEN
from .conftest import loop_failures
from .test_disaggregated import disaggregated, pushed, until_idle
from .test_engine_http import launch_engine

PROMPT = list(range(400, 450))  # 50 tokens: chunks of 40 and 10 at a token budget of 40
BLOCK_BYTES = 2 * 16 * 2 * 64 * 4  # one block of one layer of the tiny model in float32
LAYERS = 4


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("push-chunks")
    common = {"KVMESH_ENGINE_DATAPLANE": "tcp", "KVMESH_ENGINE_KV_TIMEOUT_MS": "3000",
              "KVMESH_ENGINE_KV_LEASE_MS": "1500", "KVMESH_ENGINE_DTYPE": "float32"}
    children = {
        "prefill": launch_engine(run_dir / "prefill", tiny_checkpoint, KVMESH_ENGINE_ROLE="prefill",
                                 KVMESH_ENGINE_ENGINE_ID="p0", KVMESH_ENGINE_TOKEN_BUDGET="40",
                                 KVMESH_ENGINE_PREFIX_CACHING="false", **common),  # the same prompt twice, both computed
        "decode": launch_engine(run_dir / "decode", tiny_checkpoint, KVMESH_ENGINE_ROLE="decode",
                                KVMESH_ENGINE_ENGINE_ID="d0", **common),
    }
    try:
        for child in children.values():
            child.wait_ready(timeout=120)
        yield children
    finally:
        for child in children.values():
            child.stop()
    assert {name: loop_failures(child.log_path) for name, child in children.items()} == {n: [] for n in children}


@pytest.fixture
async def clients(engines):
    async with ServiceClient(engines["prefill"].url, token=TOKEN) as prefill, \
            ServiceClient(engines["decode"].url, token=TOKEN) as decode:
        yield {"prefill": prefill, "decode": decode}
        for client in (prefill, decode):  # every block free on both engines, nothing held
            await until_idle(client)


async def steps_since(client: ServiceClient, since: int) -> EngineSteps:
    return await client.call("GET", f"/v1/steps?since={since}", into=EngineSteps)


async def test_a_two_chunk_prompt_pushed_is_written_in_both_steps_and_decodes_as_pulled(clients):
    before = (await steps_since(clients["prefill"], 0)).recorded
    expected = await disaggregated(clients, PROMPT, 6, "pulled")
    middle = (await steps_since(clients["prefill"], 0)).recorded
    got = await pushed(clients, PROMPT, 6, "pushed")
    assert got == expected
    pulled_steps = (await steps_since(clients["prefill"], before)).steps[:middle - before]
    pushed_steps = (await steps_since(clients["prefill"], middle)).steps
    assert [s.prefill_tokens for s in pulled_steps] == [s.prefill_tokens for s in pushed_steps] == [40, 10]
    assert [s.pushed_bytes for s in pulled_steps] == [0, 0]
    # blocks 0-2 (40 tokens), then 2-3 (block 2 completed, written again)
    assert [s.pushed_bytes for s in pushed_steps] == [3 * LAYERS * BLOCK_BYTES, 2 * LAYERS * BLOCK_BYTES]
