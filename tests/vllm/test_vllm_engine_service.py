"""The engine service on stock vLLM (`backend = "vllm"`): a 1P1D cluster whose engines are vLLM
instances (one core each) behind kvmesh's own kvmeta, scheduler and admission, driven by the openai
client as users drive it. Greedy answers equal the prefill engine's own colocated answer, the decode
engine pulled the prompt's KV (cached tokens), the native engine's API refuses what vLLM cannot do,
and every block comes back."""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from kvmesh.infra.local.processes import VLLM_VENV_PYTHON, Child
from kvmesh.libs.controlplane import RemoteError, ServiceClient

from ..conftest import TOKEN, cluster_name, start_kvmeta
from ..integration.admission_fixtures import launch, launch_engine, ready, wait_until_idle
from ..integration.test_policy_swap import counter

KEY = "sk-vllm-backend"
DECODE_POLICIES = {"preemption_order": "cacheopt", "prefill_admission": "layerkv", "kv_allocation": "cacheopt"}
PROMPT = "the vLLM backend answers through kvmesh's admission, " * 3


@pytest.fixture(scope="module")
def vllm_cluster(vllm_model, tmp_path_factory: pytest.TempPathFactory, redis_url: str,
                 request: pytest.FixtureRequest):
    run_dir = tmp_path_factory.mktemp("vllm-cluster")
    cores = sorted(os.sched_getaffinity(0))
    with ExitStack() as stack:
        kvmeta = start_kvmeta(run_dir, redis_url, cluster_name(request))
        stack.callback(kvmeta.child.stop)
        engines = {}
        for (engine_id, role), core in zip({"vllm-p0": "prefill", "vllm-d0": "decode"}.items(), (cores[0], cores[-1])):
            engines[engine_id] = launch_engine(run_dir, kvmeta.url, engine_id, role, str(VLLM_VENV_PYTHON),
                                               KVMESH_ENGINE_BACKEND="vllm", KVMESH_ENGINE_MODEL=str(vllm_model),
                                               KVMESH_ENGINE_BLOCK_SIZE="32", KVMESH_ENGINE_DEVICE_BYTES=str(64 << 20),
                                               KVMESH_ENGINE_MAX_MODEL_LEN="1024", KVMESH_ENGINE_KV_LEASE_MS="5000",
                                               VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1",
                                               KVMESH_TRACE_FILE=str(run_dir / f"{engine_id}.spans.jsonl"),
                                               **({"KVMESH_ENGINE_POLICIES": json.dumps(DECODE_POLICIES)}
                                                  if role == "decode" else {}))
            stack.callback(engines[engine_id].stop)
        for engine in engines.values():
            engine.wait_ready(timeout=180)
        scheduler = ready(stack, launch("scheduler", run_dir, KVMESH_KVMETA_URL=kvmeta.url))
        admission = ready(stack, launch("admission", run_dir, KVMESH_SCHEDULER_URL=scheduler.url, KVMESH_API_KEY=KEY))
        yield admission, engines


async def spans(engine: Child, name: str, timeout_s: float = 10.0) -> list[dict]:
    """The engine's spans of that name (its trace file, beside its run directory), waiting for some:
    spans reach the file in batches, about a second apart (longer on a busy machine)."""
    path = Path(engine.env["KVMESH_TRACE_FILE"])
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        found = [span for span in map(json.loads, lines) if span["name"] == name]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.2)


async def colocated(engine_url: str, prompt: str, max_tokens: int) -> str:
    """The prefill engine answering by itself, no hand-off: what one vLLM instance says."""
    async with ServiceClient(engine_url, token=TOKEN) as client:
        frames = [f async for f in client.frames("/v1/generate", {"prompt": prompt, "max_tokens": max_tokens,
                                                                  "temperature": 0.0, "ignore_eos": True}, dict)]
    return "".join(f["text"] for f in frames)


async def test_openai_clients_through_admission_get_what_one_vllm_instance_says(vllm_cluster):
    admission, engines = vllm_cluster
    async with openai.AsyncOpenAI(base_url=admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        reply = await client.completions.create(model=model_name(engines), prompt=PROMPT, max_tokens=12,
                                                temperature=0.0, extra_body={"ignore_eos": True})
        streamed = [chunk async for chunk in await client.completions.create(
            model=model_name(engines), prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True})]
        chat = await client.chat.completions.create(model=model_name(engines), max_tokens=4,
                                                    messages=[{"role": "user", "content": "hello"}])
    expected = await colocated(engines["vllm-p0"].url, PROMPT, 12)
    assert reply.choices[0].text == expected == "".join(c.choices[0].text for c in streamed if c.choices)
    assert reply.usage.completion_tokens == 12 and chat.usage.completion_tokens == 4
    # the decode engine pulled the whole prompt's KV (vLLM counts it all as cached; it computes only the
    # last token again, to sample from)
    assert reply.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens > 0
    for engine in engines.values():
        state = await wait_until_idle(engine.url, timeout=10)
        assert state["backend"] == "vllm" and state["free_blocks"] == state["total_blocks"], state
    # the engines' series, as the native engine's, for the same dashboards
    decode = await wait_until_idle(engines["vllm-d0"].url)
    assert counter(engines["vllm-d0"].url, "kvmesh_engine_kv_transfer_bytes_total") == decode["kv_transfer"]["bytes"] > 0
    assert counter(engines["vllm-d0"].url, "kvmesh_engine_generated_tokens_total") == decode["generated_tokens"] >= 12
    assert counter(engines["vllm-p0"].url, "kvmesh_engine_kv_total_blocks") > 0
    # and the phases of each request in its trace, as the native engine records them
    pulls = await spans(engines["vllm-d0"], "kv.transfer")
    assert pulls and all(s["attributes"]["kvmesh.bytes"] > 0 for s in pulls)
    assert await spans(engines["vllm-p0"], "prefill.compute") and await spans(engines["vllm-d0"], "decode.compute")


def model_name(engines) -> str:
    """The model id admission lists: the engines' `model` setting."""
    return engines["vllm-p0"].env["KVMESH_ENGINE_MODEL"]


GENERATE = "/v1/generate"   # the phase routes, /v1/prefill and /v1/decode, check their bodies too


@pytest.mark.parametrize("engine_id, path, body, message", [
    ("vllm-p0", GENERATE, {"prompt": "x", "max_tokens": 1, "kv_transfer": {"mode": "push"}}, "pull mode only"),
    ("vllm-p0", "/v1/prefill", {"prompt": "x", "max_tokens": 4}, "max_tokens 1"),
    ("vllm-d0", "/v1/decode", {"prompt": "x"}, "missing required field `kv_source`"),
    ("vllm-d0", GENERATE, {"prompt": "x", "max_tokens": 1, "kv_transfer": {}}, "does not hand off KV"),
    ("vllm-p0", GENERATE, {"prompt_token_ids": [1, 2, 3], "kv_source": {
        "engine": "e", "data_address": "127.0.0.1:1", "request_id": "r", "num_tokens": 2, "block_size": 32,
        "layers": [[0]]}}, "does not pull KV"),
    ("vllm-d0", GENERATE, {"prompt_token_ids": [1, 2, 3], "kv_source": {
        "engine": "e", "data_address": "127.0.0.1:1", "request_id": "r", "num_tokens": 2, "block_size": 16,
        "layers": [[0]]}}, "do not fit this engine"),
    ("vllm-d0", GENERATE, {"prompt_token_ids": [1, 10**9]}, "outside the vocabulary"),
    ("vllm-d0", GENERATE, {"prompt": "x", "max_tokens": 5000}, "context limit of 1024"),
])
async def test_what_the_vllm_backend_cannot_do_is_a_400(vllm_cluster, engine_id, path, body, message):
    _, engines = vllm_cluster
    async with ServiceClient(engines[engine_id].url, token=TOKEN, retries=0) as client:
        with pytest.raises(RemoteError) as refused:
            [f async for f in client.frames(path, body, dict)]
        assert refused.value.status == 400 and message in refused.value.message
        state = await client.call("GET", "/v1/state", into=dict)
    assert state["free_blocks"] == state["total_blocks"]


async def test_kvmesh_scheduler_runs_the_configured_policies_and_switches_them(vllm_cluster):
    _, engines = vllm_cluster
    async with ServiceClient(engines["vllm-d0"].url, token=TOKEN, retries=0) as decode, \
            ServiceClient(engines["vllm-p0"].url, token=TOKEN, retries=0) as prefill:
        state = await decode.call("GET", "/v1/state", into=dict)
        assert state["policies"] == DECODE_POLICIES
        cost = state["prefill_cost"]   # LayerKV's Eq. 3, profiled on this vLLM engine at start
        assert cost["alpha"] > 0 and cost["flops_per_s"] > 0 and cost["num_params"] > 0 and cost["hidden_size"] > 0
        assert (await prefill.call("GET", "/v1/state", into=dict))["prefill_cost"] is None   # fcfs: not profiled
        switched = await decode.call("PUT", "/v1/policy", {"policies": {"preemption_order": "srtf"}}, into=dict)
        assert switched["policies"] == {**DECODE_POLICIES, "preemption_order": "srtf"}
        for wrong, message in (({"layer_offload": "layerkv"}, "no policy hook layer_offload on the vLLM backend"),
                               ({"preemption_order": "nonsense"}, "nonsense")):
            with pytest.raises(RemoteError) as refused:
                await decode.call("PUT", "/v1/policy", {"policies": wrong})
            assert refused.value.status == 400 and message in refused.value.message
        back = await decode.call("PUT", "/v1/policy", {"policies": DECODE_POLICIES}, into=dict)
        assert back["policies"] == DECODE_POLICIES
