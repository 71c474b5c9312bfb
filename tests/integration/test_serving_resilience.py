"""The disaggregated cluster under trouble, through the front door (issue 5): clients leaving
mid-stream, a prefill engine joining under load, and kill -9 of a prefill and of a decode engine.
Two prefill and two decode engines, real processes; every test ends with each surviving engine's
blocks all free."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import aiohttp
import pytest

from kvmesh.infra.local.processes import Child, tail

from ..conftest import cluster_name
from .admission_fixtures import MODEL, Cluster, engine_state, idle, launch_engine, start_cluster, wait_until_idle

KEY = "sk-resilience"
ROLES = {"engine-p0": "prefill", "engine-p1": "prefill", "engine-d0": "decode", "engine-d1": "decode"}
# Short leases and heartbeats, so that what the dead leave behind is reclaimed within the test.
ENGINE_ENV = {"KVMESH_ENGINE_KV_LEASE_MS": "2000", "KVMESH_ENGINE_KV_TIMEOUT_MS": "2000",
              "KVMESH_ENGINE_HEARTBEAT_TTL_MS": "1000"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with ExitStack() as exits:
        run_dir = tmp_path_factory.mktemp("resilience")
        found = start_cluster(exits, run_dir, redis_url, cluster_name(request), ROLES, engine_env=ENGINE_ENV,
                              KVMESH_API_KEY=KEY, KVMESH_ADMISSION_STALL_TIMEOUT_S="3",
                              KVMESH_ADMISSION_REQUESTS_PER_S="0")  # 100 clients at once is the point
        found.run_dir, found.exits = run_dir, exits  # engines a test adds are stopped with the rest
        yield found


@dataclass
class Outcome:
    tokens: int = 0
    finished: bool = False  # a finish_reason arrived
    error: str | None = None  # an error status or error event
    seconds: float = 0.0


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                   leave_after: int | None = None, outcome: Outcome | None = None) -> Outcome:
    """One streamed completion; `leave_after` tokens in, the client hangs up. `outcome`, if given, is
    filled in as the stream goes (what a test that gives up waiting can still read)."""
    outcome, started = outcome or Outcome(), time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        if response.status != 200:
            outcome.error = f"HTTP {response.status}"
            return outcome
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                outcome.error = event["error"]["message"]
                break
            choice = event["choices"][0]
            outcome.tokens += 1
            outcome.finished = choice["finish_reason"] is not None
            if leave_after is not None and outcome.tokens >= leave_after:
                break  # leaving the context closes the connection mid-stream
    outcome.seconds = time.monotonic() - started
    return outcome


def prompts(n: int, length: int = 48) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 400 for j in range(length)] for i in range(n)]


async def all_idle(cluster: Cluster, engines: list[str], timeout: float = 10.0) -> None:
    for name in engines:
        state = await wait_until_idle(cluster.engines[name].url, timeout)
        assert idle(state), f"{name}: {state}"


async def a_new_engine(cluster: Cluster, engine_id: str, role: str) -> Child:
    """One more engine in the module's cluster (stopped with it), ready."""
    newcomer = launch_engine(cluster.run_dir, cluster.kvmeta.url, engine_id, role, **ENGINE_ENV)
    cluster.exits.callback(newcomer.stop)
    cluster.engines[engine_id] = newcomer
    await asyncio.to_thread(newcomer.wait_ready, 120)
    return newcomer


async def test_a_hundred_clients_leaving_mid_stream_free_every_block(cluster):
    async with aiohttp.ClientSession() as session:
        outcomes = await asyncio.gather(*(complete(session, cluster.admission.url, p, 200, leave_after=2 + i % 5)
                                          for i, p in enumerate(prompts(100))))
    assert all(o.tokens >= 2 and not o.finished for o in outcomes), [o for o in outcomes if o.tokens < 2 or o.finished][:5]
    await all_idle(cluster, list(ROLES))


async def test_a_prefill_engine_added_under_load_gets_requests_without_a_restart(cluster):
    async with aiohttp.ClientSession() as session:
        load = [asyncio.ensure_future(complete(session, cluster.admission.url, p, 24)) for p in prompts(12)]
        newcomer = await a_new_engine(cluster, "engine-p2", "prefill")
        later = await asyncio.gather(*(complete(session, cluster.admission.url, p, 8) for p in prompts(12, 40)))
        earlier = await asyncio.gather(*load)
    assert all(o.finished and not o.error for o in earlier + later)
    assert (await engine_state(newcomer.url))["steps"] > 0  # it prefilled some of the later requests
    await all_idle(cluster, list(cluster.engines))


@pytest.mark.parametrize("victim, survivors", [
    ("engine-p0", ["engine-p1", "engine-p2", "engine-d0", "engine-d1"]),
    ("engine-d0", ["engine-p1", "engine-p2", "engine-d1"]),
])
async def test_kill_9_of_an_engine_under_load_ends_every_request_in_seconds_and_leaks_nothing(cluster, victim,
                                                                                              survivors):
    async with aiohttp.ClientSession() as session:
        outcomes = [Outcome() for _ in range(16)]
        load = [asyncio.ensure_future(complete(session, cluster.admission.url, p, 64, outcome=o))
                for p, o in zip(prompts(16, 64), outcomes)]
        await asyncio.sleep(1.0)  # requests are in every phase by now
        cluster.engines[victim].process.send_signal(signal.SIGKILL)
        cluster.engines[victim].process.wait()
        killed = time.monotonic()
        _, pending = await asyncio.wait(load, timeout=30)
        if pending:
            for stuck in pending:
                stuck.cancel()
            still_open = [(i, o.tokens) for i, o in enumerate(outcomes) if not (o.finished or o.error)]
            pytest.fail(f"30 s after kill -9 of {victim}, {len(pending)} streams were still open, (request, tokens "
                        f"so far): {still_open}\n--- admission:\n{tail(cluster.admission.log_path)}"
                        f"\n--- scheduler:\n{tail(cluster.scheduler.log_path)}")
        assert all(o.finished or o.error for o in outcomes)  # each one completed or said why not
        assert time.monotonic() - killed < 15
        after = await asyncio.gather(*(complete(session, cluster.admission.url, p, 8) for p in prompts(6, 30)))
    assert all(o.finished and not o.error for o in after), after  # the cluster keeps serving
    await all_idle(cluster, survivors, timeout=10)  # leased blocks the dead decode engine never pulled included


async def test_kill_9_of_the_scheduler_under_load_fails_no_request(cluster):
    """The scheduler is consulted once per request, to route it. While it is dead, and until it is back
    (restarted here as the supervisor would), admission asks again: requests wait, none fails."""
    engines = [name for name, child in cluster.engines.items() if child.process.poll() is None]
    async with aiohttp.ClientSession() as session:
        load = []
        for i, prompt in enumerate(prompts(12, 32)):
            load.append(asyncio.ensure_future(complete(session, cluster.admission.url, prompt, 12)))
            if i == 3:
                cluster.scheduler.kill()
            if i == 8:  # about a second later
                cluster.scheduler.start()
            await asyncio.sleep(0.2)
        outcomes = await asyncio.gather(*load)
    assert all(o.finished and not o.error for o in outcomes), outcomes
    await all_idle(cluster, engines)


async def test_kill_9_of_a_decode_engine_costs_a_whole_answer_only_time(cluster):
    """A request answered whole (not streamed) has sent its client nothing when its decode engine dies
    mid-decode: admission runs it again from the start, and the client gets every token."""
    await a_new_engine(cluster, "engine-d2", "decode")
    victim = "engine-d1"
    survivors = [name for name, child in cluster.engines.items() if child.process.poll() is None and name != victim]
    headers = {"Authorization": f"Bearer {KEY}"}

    async def whole(session: aiohttp.ClientSession, prompt: list[int]) -> tuple[int, int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
        async with session.post(cluster.admission.url + "/v1/completions", json=body, headers=headers) as response:
            answer = await response.json()
            return response.status, answer.get("usage", {}).get("completion_tokens", 0)

    async with aiohttp.ClientSession() as session:
        load = [asyncio.ensure_future(whole(session, prompt)) for prompt in prompts(12, 40)]
        while not (await engine_state(cluster.engines[victim].url))["running"]:
            await asyncio.sleep(0.05)
        cluster.engines[victim].kill()  # with requests mid-decode
        answers = await asyncio.gather(*load)
    assert answers == [(200, 160)] * len(answers)
    await all_idle(cluster, survivors, timeout=10)


async def test_kill_9_of_a_decode_engine_mid_stream_migrates_the_streams(cluster):
    """Streams whose decode engine dies mid-answer migrate: another engine gets the prompt with the
    tokens already sent and makes the rest, so every client's stream goes on to its finish."""
    await a_new_engine(cluster, "engine-d3", "decode")
    victim = "engine-d3"
    survivors = [name for name, child in cluster.engines.items() if child.process.poll() is None and name != victim]
    async with aiohttp.ClientSession() as session:
        outcomes = [Outcome() for _ in range(12)]
        load = [asyncio.ensure_future(complete(session, cluster.admission.url, p, 160, outcome=o))
                for p, o in zip(prompts(12, 40), outcomes)]
        while not (await engine_state(cluster.engines[victim].url))["running"]:
            await asyncio.sleep(0.05)
        migrated = [i for i, o in enumerate(outcomes) if o.tokens and not o.finished]  # mid-stream somewhere
        cluster.engines[victim].kill()  # with streams mid-decode on it
        await asyncio.wait_for(asyncio.gather(*load), 60)
    assert migrated and all(o.finished and not o.error for o in outcomes), outcomes
    await all_idle(cluster, survivors, timeout=10)
