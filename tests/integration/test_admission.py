"""Admission, the OpenAI-compatible front door, against a real cluster: the official `openai` client
streaming and not, bad input answered OpenAI-style (never a 500), API keys, rate limits, the bounded
queue, retries on another engine, and a client that goes away freeing every block it held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.infra.local.processes import Child, free_port
from kvmesh.libs.controlplane import ServiceClient
from kvmesh.libs.kvmeta.messages import BlockGeometry, Capacity, WorkerInfo
from kvmesh.services.engine.native.models.presets import offline_tokenizer

from ..conftest import TOKEN, Kvmeta, cluster_name
from ..kvmeta_invariants import assert_consistent
from .admission_fixtures import MODEL, Cluster, engine_state, idle, launch, ready, start_cluster, wait_until_idle

KEY = "sk-test-key"
TIGHT_KEYS = ["sk-rate", "sk-other", "sk-queue"]


@dataclass
class Stack:
    """A colocated cluster (one `both` engine) with two admissions: `admission`, and `tight` with small
    limits for the rate-limit and queue tests."""

    kvmeta: Kvmeta
    scheduler: Child
    admission: Child
    engine: Child
    tight: Child


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("admission")
    with ExitStack() as exits:
        cluster = start_cluster(exits, run_dir, redis_url, cluster_name(request), {"engine-0": "both"},
                                KVMESH_API_KEY=KEY)
        tight = ready(exits, launch(
            "admission", run_dir / "tight", KVMESH_SCHEDULER_URL=cluster.scheduler.url,
            KVMESH_ADMISSION_API_KEYS=f'["{TIGHT_KEYS[0]}", "{TIGHT_KEYS[1]}"]',
            KVMESH_ADMISSION_API_KEY_FILE=str(_key_file(run_dir, TIGHT_KEYS[2])),
            KVMESH_ADMISSION_REQUESTS_PER_S="1", KVMESH_ADMISSION_BURST="3",
            KVMESH_ADMISSION_MAX_RUNNING="1", KVMESH_ADMISSION_MAX_QUEUED="0"))
        yield Stack(cluster.kvmeta, cluster.scheduler, cluster.admission, cluster.engines["engine-0"], tight)
        with cluster.kvmeta.redis() as redis:
            assert_consistent(redis, cluster.kvmeta.prefix)


@pytest.fixture(scope="module")
def split_spans(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the disaggregated cluster's services append their trace spans."""
    return tmp_path_factory.mktemp("disaggregated-spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest,
                  split_spans: Path) -> Iterator[Cluster]:
    """A prefill engine and a decode engine (KV pulled over tcp), with their scheduler and admission."""
    with ExitStack() as exits:
        cluster = start_cluster(exits, tmp_path_factory.mktemp("disaggregated"), redis_url,
                                cluster_name(request) + "-pd", {"engine-p0": "prefill", "engine-d0": "decode"},
                                # these tests look at what each engine of a pair sees: routes stay pairs
                                # (the default, conditional, may serve a request on the decode engine alone)
                                every_env={"KVMESH_TRACE_FILE": str(split_spans),
                                           "KVMESH_SCHEDULER_POLICY": "least_loaded"}, KVMESH_API_KEY=KEY)
        yield cluster
        with cluster.kvmeta.redis() as redis:
            assert_consistent(redis, cluster.kvmeta.prefix)


def _key_file(run_dir: Path, key: str) -> Path:
    path = run_dir / "keys"
    path.write_text(f"# admission keys\n{key}\n")
    return path


@pytest.fixture(autouse=True)
async def engine_blocks_all_free(stack: Stack):
    """Every test ends with the engine idle and every block free."""
    yield
    state = await wait_until_idle(stack.engine.url)
    assert idle(state), state


@pytest.fixture
async def client(stack: Stack):
    async with openai.AsyncOpenAI(base_url=stack.admission.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


async def engine_greedy(stack: Stack, max_tokens: int, **prompt) -> tuple[list[int], str]:
    """What the engine itself generates, greedily, for the same prompt."""
    async with ServiceClient(stack.engine.url, token=TOKEN) as engine:
        frames = [f async for f in engine.frames("/v1/generate", {**prompt, "max_tokens": max_tokens,
                                                                   "temperature": 0.0, "ignore_eos": True}, dict)]
    return [t for f in frames for t in f["token_ids"]], "".join(f["text"] for f in frames)


# -- the official client --------------------------------------------------------------------------


async def test_openai_client_completion_returns_the_engines_greedy_tokens(stack, client):
    answer = await client.completions.create(model=MODEL, prompt="The cache holds", max_tokens=8, temperature=0,
                                             logprobs=1, extra_body={"ignore_eos": True})
    ids, text = await engine_greedy(stack, 8, prompt="The cache holds")
    choice = answer.choices[0]
    assert answer.object == "text_completion" and answer.model == MODEL and answer.id.startswith("cmpl-")
    assert choice.text == text and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == 8 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    prompt_tokens = len(offline_tokenizer(2048).encode("The cache holds"))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 8)
    assert answer.usage.total_tokens == prompt_tokens + 8


async def test_openai_client_chat_returns_the_engines_greedy_tokens(stack, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the cache?"}]
    answer = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
    tokenizer = offline_tokenizer(2048)  # the tiny preset's
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    ids, text = await engine_greedy(stack, 6, prompt_token_ids=list(prompt))
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == text and choice.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), 6)


async def test_openai_client_streams_chat_with_usage(stack, client):
    messages = [{"role": "user", "content": "Stream it."}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                                 extra_body={"ignore_eos": True})
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    content = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert content[0].choices[0].delta.role == "assistant" and len(content) == 7
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_openai_client_streams_completions(stack, client):
    stream = await client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    ids, text = await engine_greedy(stack, 5, prompt_token_ids=[5, 6, 7, 8])
    assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == "length"


async def test_models_lists_what_the_engines_serve(client):
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


# -- bad input at the front door ------------------------------------------------------------------


@pytest.mark.parametrize("path, body, status, code", [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"", 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"model": "tiny"}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "8"}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": "hot"}', 400, None),
    ("/v1/completions", b'{"model": 7, "prompt": "x"}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, "a"]}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["a", "b"]}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 99999]}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": [-1]}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 5000}', 400, "context_length_exceeded"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 2}', 400, "unsupported_parameter"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": 3}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 0}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": [""]}', 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "echo": true}', 400, "unsupported_parameter"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "ttft_ms": -5}', 400, None),
    ("/v1/completions", b'{"model": "no-such-model", "prompt": "x"}', 404, "model_not_found"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}', 400, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     400, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}',
     400, "unsupported_parameter"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "%s"}]}' % (b"word " * 3000),
     400, "context_length_exceeded"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404,
     "model_not_found"),
])
async def test_bad_input_gets_an_openai_error_never_a_500(stack, path, body, status, code):
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.admission.url + path, data=body,
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as r:
            answer = await r.json()
    assert r.status == status, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and set(error) == {"message", "type",
                                                                                            "param", "code"}
    assert error["code"] == code


async def test_an_slo_header_that_is_not_a_number_is_a_400(stack):
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.admission.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                             headers={"Authorization": f"Bearer {KEY}", "X-KVMesh-TTFT-Ms": "soon"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "ttft_ms"


async def test_slos_from_body_and_headers_are_measured(stack, client):
    # Three tokens for sure (greedy, EOS ignored): a TBT needs two, and sampling could end at the first.
    await client.completions.create(model=MODEL, prompt="slo", max_tokens=3, temperature=0,
                                    extra_body={"ttft_ms": 60_000, "ignore_eos": True},
                                    extra_headers={"X-KVMesh-TBT-Ms": "60000"})
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.admission.url + "/metrics") as r:
            metrics = await r.text()
    assert 'kvmesh_admission_slo_requests_total{met="true",slo="ttft",slo_class="default"}' in metrics
    assert 'kvmesh_admission_slo_requests_total{met="true",slo="tbt",slo_class="default"}' in metrics


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic abc"},
                                     {"Authorization": "Bearer "}])
async def test_missing_or_wrong_api_key_is_a_401(stack, headers):
    async with aiohttp.ClientSession() as http:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            async with http.request(method, stack.admission.url + path, json={"model": MODEL, "prompt": "x"},
                                    headers=headers) as r:
                answer = await r.json()
            assert r.status == 401 and answer["error"]["code"] == "invalid_api_key", answer


async def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(stack):
    async with openai.AsyncOpenAI(base_url=stack.admission.url + "/v1", api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.completions.create(model=MODEL, prompt="x", max_tokens=1)


# -- limits ---------------------------------------------------------------------------------------


async def test_rate_limit_is_per_key_and_answers_429_with_retry_after(stack):
    async with aiohttp.ClientSession() as http:
        async def models(key: str) -> aiohttp.ClientResponse:
            async with http.get(stack.tight.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                return r

        statuses = [(await models(TIGHT_KEYS[0])).status for _ in range(3)]
        limited = await models(TIGHT_KEYS[0])
        other = await models(TIGHT_KEYS[1])
    assert statuses == [200] * 3
    assert limited.status == 429 and int(limited.headers["Retry-After"]) >= 1
    assert other.status == 200  # each key has its own bucket


async def test_a_full_queue_answers_429_with_retry_after(stack):
    body = {"model": MODEL, "prompt": "hold the only slot", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {TIGHT_KEYS[2]}"}
        async with http.post(stack.tight.url + "/v1/completions", json=body, headers=headers) as holding:
            assert holding.status == 200
            await holding.content.readline()  # the first token: the only running slot is taken
            async with http.post(stack.tight.url + "/v1/completions", json={**body, "stream": False},
                                 headers=headers) as refused:
                answer = await refused.json()
        # leaving the stream is a disconnect: the engine frees the blocks (checked after the test)
    assert refused.status == 429 and answer["error"]["code"] == "queue_full"
    assert int(refused.headers["Retry-After"]) >= 1


async def test_a_request_that_would_wait_past_its_limit_behind_others_answers_429_with_retry_after(stack, tmp_path):
    """Overload: admission refuses a request that can expect to wait longer than its TTFT SLO (else
    max_wait_s) for the requests ahead of it to get their first tokens, and only then; its SLO, when it
    names one, is its limit."""
    with ExitStack() as exits:
        admission = ready(exits, launch("admission", tmp_path, KVMESH_SCHEDULER_URL=stack.scheduler.url,
                                        KVMESH_API_KEY=KEY, KVMESH_ADMISSION_MAX_RUNNING="1",
                                        KVMESH_ADMISSION_MAX_WAIT_S="0.001"))
        url = admission.url + "/v1/completions"
        quick = {"model": MODEL, "prompt": "a first token", "max_tokens": 1}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
            async def status(body: dict) -> tuple[int, dict, str | None]:
                async with http.post(url, json=body) as r:
                    return r.status, await r.json(), r.headers.get("Retry-After")

            for _ in range(4):  # first tokens: how fast they come is known from here on
                assert (await status(quick))[0] == 200
            assert (await status({**quick, "ttft_ms": 1}))[0] == 200  # nobody ahead: no wait, whatever its SLO
            hold = {"model": MODEL, "prompt": "hold the only slot", "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}
            async with http.post(url, json=hold) as holding:
                await holding.content.readline()  # its first token came: the only running slot is taken
                queued = asyncio.ensure_future(status({**quick, "ttft_ms": 600_000}))  # one ahead, waiting
                await _until(lambda: _gauge(http, admission.url, "kvmesh_admission_queued_requests"), 1.0)
                refused = [await status(body) for body in (quick, {**quick, "ttft_ms": 1})]
                patient = asyncio.ensure_future(status({**quick, "ttft_ms": 600_000}))
                await _until(lambda: _gauge(http, admission.url, "kvmesh_admission_queued_requests"), 2.0)
            # leaving the stream frees the slot: the two that could wait are answered
            assert [(await queued)[0], (await patient)[0]] == [200, 200]
    for code, answer, retry_after in refused:
        assert code == 429 and answer["error"]["code"] == "queue_full", answer
        assert "behind" in answer["error"]["message"] and int(retry_after) >= 1


async def _gauge(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def _until(read, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await read() != value:
        assert time.monotonic() < deadline, f"still not {value}"
        await asyncio.sleep(0.02)


async def test_a_body_that_trickles_in_gets_a_408_on_public_and_internal_routes(stack, tmp_path):
    """A client sending its body a byte at a time holds nothing past body_timeout_s: a 408, in
    OpenAI's shape on the public route and kvmesh's on an internal one."""
    with ExitStack() as exits:
        admission = ready(exits, launch("admission", tmp_path, KVMESH_SCHEDULER_URL=stack.scheduler.url,
                                        KVMESH_API_KEY=KEY, KVMESH_ADMISSION_BODY_TIMEOUT_S="1"))
        port = int(admission.url.rsplit(":", 1)[1])
        answers = [await _trickled(port, "POST", "/v1/completions", KEY),
                   await _trickled(port, "PUT", "/v1/upstreams", TOKEN)]
    for status, body in answers:
        assert status == 408 and "did not arrive within 1 s" in body, (status, body)


async def _trickled(port: int, method: str, path: str, bearer: str) -> tuple[int, str]:
    """Send a 100-byte body's first bytes one every 0.2 s until the server answers; its status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bearer}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
    answer = asyncio.ensure_future(reader.read(65536))
    for _ in range(50):  # 10 s at most
        if answer.done():
            break
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.2)
    head = await asyncio.wait_for(answer, 10)
    writer.close()
    status_line, _, rest = head.decode().partition("\r\n")
    return int(status_line.split()[1]), rest.partition("\r\n\r\n")[2]


# -- the request lifecycle ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_goes_away_frees_every_block_at_once(stack, stream):
    body = {"model": MODEL, "prompt": "a long answer nobody waits for", "max_tokens": 1500, "ignore_eos": True,
            "stream": stream}
    async with aiohttp.ClientSession() as http:
        async def ask() -> None:
            async with http.post(stack.admission.url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"}) as response:
                await response.content.readline()  # the first token (streaming), or everything
                await asyncio.sleep(60)

        asking = asyncio.create_task(ask())
        await asyncio.sleep(0.5)
        busy = await engine_state(stack.engine.url)
        asking.cancel()  # hang up
        with contextlib.suppress(asyncio.CancelledError):
            await asking
    left = time.monotonic()
    state = await wait_until_idle(stack.engine.url, timeout=3.0)
    assert busy["running"] == 1  # the request was generating when the client left
    assert idle(state) and time.monotonic() - left < 2.0  # aborted, not run to its 1500 tokens


@contextlib.asynccontextmanager
async def dead_engine(kvmeta: Kvmeta, scheduler_url: str, role: str):
    """A registered engine that does not answer, and that the scheduler picks first (the least loaded)."""
    dead = WorkerInfo(id=f"a-dead-{role}", role=role, control_url=f"http://127.0.0.1:{free_port()}", model=MODEL,
                      geometry=BlockGeometry(block_size=16, num_layers=4, num_kv_heads=2, head_dim=64,
                                             dtype="float32"),
                      capacity=Capacity(device_blocks=10**6))
    async with kvmeta.client() as registry, ServiceClient(scheduler_url, token=TOKEN) as scheduler:
        await registry.register(dead, ttl_ms=60_000)
        try:
            for _ in range(50):
                route = await scheduler.call("POST", "/v1/route", {"model": MODEL}, into=dict)
                if route["engine" if role == "both" else role]["id"] == dead.id:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"the scheduler does not route to {dead.id}")
            yield dead
        finally:
            await registry.deregister(dead.id)


async def test_an_engine_that_fails_before_the_first_token_is_replaced(stack, client):
    async with dead_engine(stack.kvmeta, stack.scheduler.url, "both"):
        answer = await client.completions.create(model=MODEL, prompt="retry", max_tokens=4, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4


async def test_a_request_answered_with_a_503_counts_as_finished_with_error(stack, tmp_path):
    """A request admission took and then could not run (its scheduler stopped answering) is a finished
    request, `finish_reason="error"`, answered whole or streamed."""
    with ExitStack() as exits:
        admission = ready(exits, launch("admission", tmp_path, KVMESH_SCHEDULER_URL=stack.scheduler.url,
                                        KVMESH_API_KEY=KEY, KVMESH_ADMISSION_SCHEDULER_WAIT_S="0"))
        doomed = ready(exits, launch("scheduler", tmp_path / "doomed", KVMESH_KVMETA_URL=stack.kvmeta.url))
        async with openai.AsyncOpenAI(base_url=admission.url + "/v1", api_key=KEY, max_retries=0) as c:
            await c.completions.create(model=MODEL, prompt="warm", max_tokens=2)  # the tokenizer, fetched once
            async with ServiceClient(admission.url, token=TOKEN) as control:
                await control.call("PUT", "/v1/upstreams", {"scheduler_url": doomed.url})
            doomed.stop()
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as failed:
                    answer = await c.completions.create(model=MODEL, prompt="no route", max_tokens=2, stream=stream)
                    if stream:
                        async for _ in answer:
                            pass
                assert failed.value.status_code == 503
        async with aiohttp.ClientSession() as http, http.get(admission.url + "/metrics") as response:
            samples = [s for family in text_string_to_metric_families(await response.text()) for s in family.samples]
    finished = {s.labels["finish_reason"]: s.value for s in samples
                if s.name == "kvmesh_admission_finished_requests_total"}
    assert finished == {"length": 1, "error": 2}


# -- disaggregated: prefill engine, then decode engine --------------------------------------------


@pytest.fixture
async def split_client(disaggregated: Cluster):
    async with openai.AsyncOpenAI(base_url=disaggregated.admission.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c
    for engine in disaggregated.engines.values():  # nothing left running, pulling or held on either engine
        state = await wait_until_idle(engine.url)
        assert idle(state), state


async def test_disaggregated_completion_equals_the_colocated_engines_greedy(stack, disaggregated, split_client):
    decode = disaggregated.engines["engine-d0"]
    steps = (await engine_state(decode.url))["steps"]
    answer = await split_client.completions.create(model=MODEL, prompt="The cache holds", max_tokens=8, temperature=0,
                                                   logprobs=1, extra_body={"ignore_eos": True})
    ids, text = await engine_greedy(stack, 8, prompt="The cache holds")
    assert answer.choices[0].text == text and answer.usage.completion_tokens == 8
    assert len(answer.choices[0].logprobs.token_logprobs) == 8
    assert (await engine_state(decode.url))["steps"] > steps  # the decode engine generated the rest


async def test_answers_say_how_they_were_served_and_where_the_time_went(client, split_client):
    parts = {"prefill_queue", "prefill", "decode_queue", "transfer", "decode"}
    split = await split_client.completions.create(model=MODEL, prompt="Where did the time go?", max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
    info = split.model_extra["kvmesh"]
    assert info["mode"] == "disaggregated" and info["transfer_mode"] == "pull"
    assert set(info["timings_ms"]) == parts and info["timings_ms"]["transfer"] > 0 and info["timings_ms"]["prefill"] > 0
    together = await client.completions.create(model=MODEL, prompt="Where did the time go?", max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
    timings = together.model_extra["kvmesh"]["timings_ms"]
    assert together.model_extra["kvmesh"]["mode"] == "colocated" and set(timings) == parts
    assert timings["transfer"] == 0 and timings["decode"] > 0
    last = None
    async for chunk in await split_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True,
            extra_body={"ignore_eos": True}):
        last = chunk if chunk.choices and chunk.choices[0].finish_reason else last
    assert set(last.model_extra["kvmesh"]["timings_ms"]) == parts


async def test_both_engines_are_given_the_requests_slos(split_client, split_spans):
    reply = await split_client.completions.create(model=MODEL, prompt="On time", max_tokens=4,
                                                  extra_body={"ignore_eos": True, "ttft_ms": 60_000, "tbt_ms": 250})
    calls = await _engine_calls(split_spans, reply.id)
    assert {engine: (a.get("kvmesh.ttft_slo_ms"), a.get("kvmesh.tbt_slo_ms")) for engine, a in calls.items()} == {
        "engine-p0": (60_000, 250), "engine-d0": (60_000, 250)}


ENGINE_ROUTES = {"POST /v1/prefill", "POST /v1/decode", "POST /v1/generate"}


async def _engine_calls(spans_file: Path, request_id: str, timeout: float = 10.0) -> dict[str, dict]:
    """The attributes of each engine's server span (`POST /v1/prefill`, `/v1/decode` or `/v1/generate`)
    on the trace of admission's `request_id`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        spans = [json.loads(line) for line in spans_file.read_text().splitlines()] if spans_file.exists() else []
        traces = {s["trace_id"] for s in spans
                  if s["name"] == "admission" and s["attributes"].get("kvmesh.request_id") == request_id}
        calls = {s["service"]: s["attributes"] for s in spans
                 if s["trace_id"] in traces and s["name"] in ENGINE_ROUTES and s["service"].startswith("engine")}
        if len(calls) == 2 or asyncio.get_running_loop().time() > deadline:
            return calls
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def push_admission(tmp_path_factory: pytest.TempPathFactory, disaggregated: Cluster) -> Iterator[Child]:
    """A second front door on the same engines that moves KV by push instead of pull."""
    with ExitStack() as exits:
        yield ready(exits, launch("admission", tmp_path_factory.mktemp("push"), KVMESH_API_KEY=KEY,
                                  KVMESH_SCHEDULER_URL=disaggregated.scheduler.url,
                                  KVMESH_ADMISSION_TRANSFER_MODE="push"))


async def test_push_mode_through_the_front_door_equals_colocated(client, split_client, push_admission):
    async with openai.AsyncOpenAI(base_url=push_admission.url + "/v1", api_key=KEY, max_retries=0) as pushing:
        answers = await asyncio.gather(*(pushing.completions.create(
            model=MODEL, prompt=f"Push {i} the cache", max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
            for i in range(4)))
        short = await pushing.completions.create(model=MODEL, prompt="One", max_tokens=1, temperature=0)
    expected = await asyncio.gather(*(client.completions.create(
        model=MODEL, prompt=f"Push {i} the cache", max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
        for i in range(4)))
    assert [a.choices[0].text for a in answers] == [e.choices[0].text for e in expected]
    info = answers[0].model_extra["kvmesh"]
    assert info["transfer_mode"] == "push" and info["timings_ms"]["transfer"] == 0
    assert short.usage.completion_tokens == 1  # the decode engine's reservation is given back (checked at teardown)


async def test_disaggregated_streaming_chat_equals_colocated(client, split_client):
    messages = [{"role": "user", "content": "Split me."}]
    colocated = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                                     extra_body={"ignore_eos": True})
    stream = await split_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                                        stream=True, stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content for c in content) == colocated.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == colocated.usage.prompt_tokens


async def test_a_first_token_that_ends_the_request_skips_decode_and_frees_the_held_kv(disaggregated, split_client):
    prefill, decode = disaggregated.engines["engine-p0"], disaggregated.engines["engine-d0"]
    steps = (await engine_state(decode.url))["steps"]
    answer = await split_client.completions.create(model=MODEL, prompt="one token", max_tokens=1, temperature=0)
    assert answer.usage.completion_tokens == 1 and answer.choices[0].finish_reason == "length"
    assert idle(await wait_until_idle(prefill.url, timeout=2.0))  # aborted, well before its 30 s lease
    assert (await engine_state(decode.url))["steps"] == steps


async def test_disaggregated_client_that_goes_away_frees_both_engines(disaggregated, split_client):
    body = {"model": MODEL, "prompt": "a long split answer", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(disaggregated.admission.url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}) as response:
            for _ in range(3):  # the first token (from prefill) and two from decode
                await response.content.readline()
            await asyncio.sleep(0.3)  # the engine publishes its state every 0.1 s while busy
            busy = await engine_state(disaggregated.engines["engine-d0"].url)
            response.close()
    left = time.monotonic()
    for engine in disaggregated.engines.values():
        assert idle(await wait_until_idle(engine.url, timeout=3.0))
    assert busy["running"] == 1 and time.monotonic() - left < 2.0, busy


async def test_a_prefill_engine_that_fails_is_replaced(disaggregated, split_client):
    async with dead_engine(disaggregated.kvmeta, disaggregated.scheduler.url, "prefill"):
        answer = await split_client.completions.create(model=MODEL, prompt="retry the prefill", max_tokens=4,
                                                       temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4


async def test_a_pair_whose_decode_engine_is_down_answers_on_its_prefill_engine(stack, disaggregated, split_client):
    """kill -9 of the only decode engine (a supervisor would restart it): a request paired with it
    while its registration lives on (its first token from the prefill engine already) finishes on the
    prefill engine, as does one routed after; greedily, as ever."""
    decode = disaggregated.engines["engine-d0"]
    decode.kill()
    try:
        answer = await split_client.completions.create(model=MODEL, prompt="The cache holds", max_tokens=8,
                                                       temperature=0, extra_body={"ignore_eos": True})
    finally:
        decode.start()
        await asyncio.to_thread(decode.wait_ready, 120)
    assert answer.choices[0].text == (await engine_greedy(stack, 8, prompt="The cache holds"))[1]
