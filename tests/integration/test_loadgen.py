"""The load generator against a test double of an OpenAI-compatible server on loopback.

The double streams `/v1/completions` as SSE with known delays (a first token after TTFT_S, then one
chunk every GAP_S), so the generator's parsing and TTFT/TBT/end-to-end arithmetic can be checked.
Options ride in the request body, as `extra_body` fields would. The real cluster is driven by the
benchmark itself (`kvmesh bench serve`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
from aiohttp import web

from kvmesh.bench.loadgen import (LoadResult, RequestResult, breakdown, poisson_arrivals, run_load, served_model,
                                  summarize)
from kvmesh.bench.workloads import WorkRequest

KEY = "sk-test"
TTFT_S, GAP_S = 0.05, 0.02
TIMINGS = {"prefill_queue": 1.0, "prefill": 2.0, "transfer": 0.5, "decode_queue": 3.0, "decode": 40.0}


@dataclass
class Double:
    url: str
    bodies: list[dict] = field(default_factory=list)
    received: list[float] = field(default_factory=list)  # perf_counter at each request's arrival
    open_now: int = 0
    most_open: int = 0


def _event(value: dict) -> bytes:
    return b"data: " + msgspec.json.encode(value) + b"\n\n"


def _chunk(text: str, finish: str | None = None, **extra: object) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "model": "double",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra}


@pytest.fixture
async def double() -> AsyncIterator[Double]:
    state = Double(url="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "double", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        state.received.append(time.perf_counter())
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "incorrect API key provided"}}, status=401)
        body = await request.json()
        state.bodies.append(body)
        state.open_now += 1
        state.most_open = max(state.most_open, state.open_now)
        try:
            return await _answer(request, body)
        finally:
            state.open_now -= 1

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    yield state
    await runner.cleanup()


async def _answer(request: web.Request, body: dict) -> web.StreamResponse:
    """`max_tokens` tokens, `per_chunk` a chunk (the last with kvmesh's breakdown), or an error after
    `fail_after` chunks, or one whole JSON answer when `whole`."""
    tokens, per_chunk, gap = body["max_tokens"], body.get("per_chunk", 1), body.get("gap_s", GAP_S)
    await asyncio.sleep(TTFT_S)
    if body.get("whole"):
        return web.json_response({**_chunk("x" * tokens, "length"), "usage": {"completion_tokens": tokens}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunks = -(-tokens // per_chunk)
    for i in range(chunks):
        if i:
            await asyncio.sleep(gap)
        if i == body.get("fail_after"):
            await response.write(_event({"error": {"message": "engine failed", "code": "engine_failed"}}))
            break
        last = i == chunks - 1
        extra = {"kvmesh": {"timings_ms": TIMINGS, "mode": "disaggregated", "transfer_mode": "pull"}} if last else {}
        await response.write(_event(_chunk(" tok" * per_chunk, "length" if last else None, **extra)))
    else:
        await response.write(_event({**_chunk("", None), "choices": [],
                                     "usage": {"prompt_tokens": 4, "completion_tokens": tokens}}))
    await response.write(b"data: [DONE]\n\n")
    return response


def _requests(n: int, max_tokens: int = 5) -> list[WorkRequest]:
    return [WorkRequest(prompt_ids=[16, 17, 18, 19], max_tokens=max_tokens) for _ in range(n)]


async def test_ttft_tbt_and_end_to_end_follow_the_stream(double: Double):
    load = await run_load(double.url, _requests(3), rate=50.0, model="double", api_key=KEY)
    assert [r.error for r in load.results] == [None] * 3
    for r in load.results:
        assert TTFT_S <= r.ttft < TTFT_S + 0.1
        # the server spaces the 4 later tokens GAP_S apart from TTFT_S; a first token read late (a
        # busy machine) shortens what follows it by that lateness at most
        assert GAP_S * 0.9 - (r.ttft - TTFT_S) / 4 <= r.tbt < GAP_S + 0.03
        assert r.e2e >= TTFT_S + 4 * GAP_S and r.e2e - r.token_times[-1] < 0.05
        assert r.completion_tokens == 5 and len(r.token_times) == 5
    figures = summarize(load)
    assert figures["completed"] == 3 and figures["failed"] == 0
    assert figures["ttft_p50_ms"] <= figures["ttft_p90_ms"] and figures["e2e_p90_ms"] >= 1e3 * (TTFT_S + 4 * GAP_S)


async def test_the_request_is_a_streaming_completion_with_token_ids_and_the_extra_body(double: Double):
    await run_load(double.url, _requests(1, max_tokens=7), rate=10.0, model="double", api_key=KEY,
                   extra_body={"ignore_eos": True, "min_tokens": 7})
    body = double.bodies[0]
    assert body["prompt"] == [16, 17, 18, 19] and body["max_tokens"] == 7 and body["stream"] is True
    assert body["ignore_eos"] is True and body["min_tokens"] == 7 and body["model"] == "double"
    assert body["stream_options"] == {"include_usage": True}


async def test_tbt_counts_tokens_not_chunks_when_chunks_carry_several(double: Double):
    load = await run_load(double.url, _requests(1, max_tokens=8), rate=10.0, model="double", api_key=KEY,
                          extra_body={"per_chunk": 2, "gap_s": 0.04})
    (r,) = load.results
    assert len(r.token_times) == 4 and r.completion_tokens == 8
    assert r.tbt == pytest.approx((r.token_times[-1] - r.token_times[0]) / 7)
    assert 3 * 0.04 / 7 * 0.9 <= r.tbt < 3 * 0.06 / 7


async def test_the_kvmesh_breakdown_is_read_from_the_last_chunk(double: Double):
    load = await run_load(double.url, _requests(2), rate=50.0, model="double", api_key=KEY)
    assert load.results[0].kvmesh["transfer_mode"] == "pull"
    assert breakdown(load) == pytest.approx(TIMINGS)


async def test_a_whole_json_answer_counts_as_one_token_event(double: Double):
    load = await run_load(double.url, _requests(1), rate=10.0, model="double", api_key=KEY, extra_body={"whole": True})
    (r,) = load.results
    assert r.ok and r.ttft == pytest.approx(r.e2e, abs=0.01) and r.completion_tokens == 5 and r.tbt is None


async def test_refusals_and_errors_in_the_stream_are_failures(double: Double):
    refused = await run_load(double.url, _requests(2), rate=50.0, model="double", api_key="wrong")
    assert all(r.error.startswith("HTTP 401") for r in refused.results)
    broken = await run_load(double.url, _requests(1), rate=10.0, model="double", api_key=KEY,
                            extra_body={"fail_after": 2})
    assert "engine_failed" in broken.results[0].error and not broken.results[0].ok
    assert summarize(broken)["failed"] == 1 and np.isnan(summarize(broken)["e2e_p90_ms"])
    assert summarize(broken)["e2e_p90_every_ms"] == np.inf   # every request counts: the failure sits on top


def test_every_request_percentiles_put_a_failure_at_the_top():
    ok = [RequestResult(index=i, prompt_tokens=4, max_tokens=2, arrival=0.0, ttft=0.1 * i, e2e=float(i),
                        token_times=[0.1 * i, float(i)], completion_tokens=2) for i in range(1, 10)]
    failed = RequestResult(index=9, prompt_tokens=4, max_tokens=2, arrival=0.0, error="timeout")
    figures = summarize(LoadResult(rate=1.0, wall_s=10.0, results=[*ok, failed], unsent=0))
    assert figures["e2e_p50_ms"] == pytest.approx(5000) and figures["e2e_p90_ms"] == pytest.approx(8200)
    # ten requests, one failed: the P50 moves up half a rank, the P90 lands between 9 s and the failure
    assert figures["e2e_p50_every_ms"] == pytest.approx(5500) and figures["e2e_p90_every_ms"] == np.inf
    assert figures["failed"] == 1 and figures["ttft_p50_every_ms"] == pytest.approx(550)


async def test_served_model_is_the_first_listed(double: Double):
    assert await served_model(double.url, KEY) == "double"


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    a, b = poisson_arrivals(5000, 20.0, seed=1), poisson_arrivals(5000, 20.0, seed=1)
    assert np.array_equal(a, b) and not np.array_equal(a, poisson_arrivals(5000, 20.0, seed=2))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert np.mean(np.diff(a)) == pytest.approx(1 / 20.0, rel=0.05)
    assert np.allclose(poisson_arrivals(100, 40.0, seed=1), a[:100] / 2)  # twice the rate, the same pattern


async def test_requests_leave_at_their_poisson_arrivals(double: Double):
    load = await run_load(double.url, _requests(8), rate=10.0, model="double", api_key=KEY, seed=5)
    # Measured against the schedule's typical start, not the first arrival: on a loaded machine the
    # first request alone can be 80 ms late (its connection), which shifts every other one.
    late = np.asarray(double.received) - poisson_arrivals(8, 10.0, seed=5)
    assert np.abs(late - np.median(late)).max() < 0.1, late - np.median(late)
    assert [r.arrival for r in load.results] == pytest.approx(poisson_arrivals(8, 10.0, seed=5).tolist())


async def test_concurrency_is_bounded(double: Double):
    load = await run_load(double.url, _requests(12, max_tokens=10), rate=1000.0, model="double", api_key=KEY,
                          concurrency=3)
    assert double.most_open == 3 and all(r.ok for r in load.results)


async def test_the_time_limit_stops_the_run(double: Double):
    began = time.perf_counter()
    load = await run_load(double.url, _requests(20, max_tokens=100), rate=10.0, model="double", api_key=KEY,
                          seed=1, time_limit_s=0.5, extra_body={"gap_s": 0.5})
    assert time.perf_counter() - began < 2.0
    assert load.unsent > 0 and len(load.results) + load.unsent == 20
    assert all(r.error == "cancelled at the time limit" for r in load.results)
    assert load.wall_s < 1.5
