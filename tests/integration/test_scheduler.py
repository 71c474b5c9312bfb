"""The scheduler as a real process beside a real kvmeta: routes follow the registry as engines join
and leave, prefix-aware routing follows the cache table, the policy switches at run time.

One kvmeta and one scheduler serve the whole module (starting processes is the slow part); each test
registers its engines under a model of its own, so tests do not see each other's engines.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest

from kvmesh.infra.local.processes import Child, free_port, port_in_use, service_child
from kvmesh.libs.controlplane import RemoteError, ServiceClient
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import Load
from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.messages.scheduler import ClusterView, MAX_PROMPT_TOKENS, PolicyInfo, Route

from ..conftest import TOKEN, Kvmeta, start_kvmeta
from ..factories import entries, worker_info
from ..polling import eventually


@pytest.fixture(scope="module")
def shared_kvmeta(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvmeta]:
    service = start_kvmeta(tmp_path_factory.mktemp("kvmeta"), redis_url, "scheduler-" + uuid.uuid4().hex[:8])
    yield service
    service.child.stop()


@pytest.fixture(scope="module")
def scheduler(shared_kvmeta: Kvmeta, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    port = free_port()
    child = service_child("scheduler", tmp_path_factory.mktemp("scheduler"), f"http://127.0.0.1:{port}", {
        "KVMESH_SCHEDULER_PORT": str(port), "KVMESH_KVMETA_URL": shared_kvmeta.url, "KVMESH_TOKEN": TOKEN,
        "KVMESH_CLUSTER": shared_kvmeta.cluster, "KVMESH_SCHEDULER_LOAD_REFRESH_S": "0.05"})
    child.start()
    child.wait_ready()
    yield child
    child.stop()


@dataclass
class Cluster:
    """A test's view: its own model name, kvmeta to register engines in, the scheduler to ask."""

    model: str
    kvmeta: KvmetaClient
    scheduler: ServiceClient
    registered: set[str]

    async def register(self, engine_id: str, role: str = "prefill", ttl_ms: int = 60_000) -> None:
        info = msgspec.structs.replace(worker_info(engine_id, role), model=self.model,
                                       control_url=f"http://127.0.0.1:9/{engine_id}", data_address=f"{engine_id}:1")
        await self.kvmeta.register(info, ttl_ms=ttl_ms)
        self.registered.add(engine_id)
        await self.until(lambda view: engine_id in ids(view))

    async def deregister(self, engine_id: str) -> None:
        await self.kvmeta.deregister(engine_id)
        self.registered.discard(engine_id)

    async def route(self, prompt: list[int] | None = None, exclude: list[str] | None = None) -> Route:
        body = {"model": self.model, "prompt_token_ids": prompt or list(range(40)), "exclude": exclude or []}
        return await self.scheduler.call("POST", "/v1/route", body, into=Route)

    async def policy(self, name: str) -> PolicyInfo:
        return await self.scheduler.call("PUT", "/v1/policy", {"policy": name}, into=PolicyInfo)

    async def view(self) -> ClusterView:
        return await self.scheduler.call("GET", "/v1/cluster", into=ClusterView)

    async def until(self, condition, timeout: float = 2.0) -> float:
        """Poll the cluster view until `condition(view)`; the seconds it took."""
        started = time.monotonic()
        await eventually(self.view, condition, timeout=timeout, interval=0.01)
        return time.monotonic() - started


def ids(view: ClusterView) -> set[str]:
    return {e.id for e in view.engines}


@pytest.fixture
async def cluster(scheduler: Child, shared_kvmeta: Kvmeta, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    async with shared_kvmeta.client() as kvmeta, ServiceClient(scheduler.url, token=TOKEN, retries=0) as client:
        test = Cluster(f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}", kvmeta, client, set())
        await test.policy("least_loaded")
        yield test
        for engine_id in list(test.registered):
            await kvmeta.deregister(engine_id)


def engine_id(cluster: Cluster, name: str) -> str:
    return f"{name}-{cluster.model[-6:]}"


async def test_route_pairs_a_prefill_engine_with_a_decode_engine(cluster: Cluster):
    p0, d0 = engine_id(cluster, "p0"), engine_id(cluster, "d0")
    await cluster.register(p0, "prefill")
    await cluster.register(d0, "decode")
    route = await cluster.route()
    assert route.mode == "disaggregated" and route.engine is None and route.policy == "least_loaded"
    assert (route.prefill.id, route.prefill.role, route.prefill.control_url, route.prefill.data_address) == \
        (p0, "prefill", f"http://127.0.0.1:9/{p0}", f"{p0}:1")
    assert (route.decode.id, route.decode.role) == (d0, "decode")


async def test_a_lone_colocated_engine_serves_the_whole_request(cluster: Cluster):
    b0 = engine_id(cluster, "b0")
    await cluster.register(b0, "both")
    await cluster.register(engine_id(cluster, "p0"), "prefill")  # a prefill engine without a decode engine
    route = await cluster.route()
    assert (route.mode, route.engine.id, route.prefill, route.decode) == ("colocated", b0, None, None)


async def test_least_loaded_follows_heartbeats_and_spreads_a_burst_between_them(cluster: Cluster):
    p0, p1, d0 = (engine_id(cluster, n) for n in ("p0", "p1", "d0"))
    for engine, role in ((p0, "prefill"), (p1, "prefill"), (d0, "decode")):
        await cluster.register(engine, role)
    await cluster.kvmeta.heartbeat(p0, Load(free_blocks={"device": 900}))
    await cluster.kvmeta.heartbeat(p1, Load(free_blocks={"device": 1000}))
    await cluster.until(lambda view: any(e.id == p1 and e.free_blocks == {"device": 1000} for e in view.engines))
    # A 40-token prompt takes 3 blocks x 4 layers: p1 leads until it has taken 100 blocks more than p0.
    picks = [(await cluster.route()).prefill.id for _ in range(12)]
    assert picks[:9] == [p1] * 9 and picks[9:] == [p0, p1, p0]


async def test_conditional_prefills_on_the_decode_engine_while_the_prefill_engine_is_backed_up(cluster: Cluster):
    p0, d0 = engine_id(cluster, "p0"), engine_id(cluster, "d0")
    await cluster.register(p0, "prefill")
    await cluster.register(d0, "decode")
    await cluster.policy("conditional")
    await cluster.kvmeta.heartbeat(p0, Load(free_blocks={"device": 1000}, waiting=1))
    await cluster.until(lambda view: any(e.id == p0 and e.waiting == 1 for e in view.engines))
    first = await cluster.route()  # one waiting: the pair, and now p0 has two and d0 one coming
    second = await cluster.route()  # p0 backed up, but d0 has a request on its way
    assert [(r.mode, r.policy) for r in (first, second)] == [("disaggregated", "conditional")] * 2
    await cluster.kvmeta.heartbeat(d0, Load(free_blocks={"device": 1000}))  # d0 reports an empty queue
    await cluster.until(lambda view: any(e.id == d0 and e.routed_since_heartbeat == 0 for e in view.engines))
    third = await cluster.route()
    assert (third.mode, third.engine.id, third.engine.role) == ("colocated", d0, "decode")


async def test_a_departed_engine_stops_being_picked_within_a_second(cluster: Cluster):
    p0, p1, d0 = (engine_id(cluster, n) for n in ("p0", "p1", "d0"))
    for engine, role in ((p0, "prefill"), (p1, "prefill"), (d0, "decode")):
        await cluster.register(engine, role)
    await cluster.policy("round_robin")
    assert {(await cluster.route()).prefill.id for _ in range(2)} == {p0, p1}
    await cluster.deregister(p1)
    took = await cluster.until(lambda view: p1 not in ids(view))
    assert took < 1.0
    assert {(await cluster.route()).prefill.id for _ in range(4)} == {p0}


async def test_a_new_prefill_engine_is_picked_without_restarting_the_scheduler(cluster: Cluster):
    p0, p1, d0 = (engine_id(cluster, n) for n in ("p0", "p1", "d0"))
    await cluster.register(p0, "prefill")
    await cluster.register(d0, "decode")
    await cluster.policy("round_robin")
    assert {(await cluster.route()).prefill.id for _ in range(3)} == {p0}
    await cluster.register(p1, "prefill")
    assert {(await cluster.route()).prefill.id for _ in range(2)} == {p0, p1}


async def test_prefix_aware_picks_the_engine_whose_cache_holds_the_prompt_prefix(cluster: Cluster):
    p0, p1, p2, d0 = (engine_id(cluster, n) for n in ("p0", "p1", "p2", "d0"))
    for engine, role in ((p0, "prefill"), (p1, "prefill"), (p2, "prefill"), (d0, "decode")):
        await cluster.register(engine, role)
    prompt = list(range(100, 170))  # 4 full blocks of 16, and 6 tokens more
    blocks = node_ids(prompt, 16, cluster.model)
    await cluster.kvmeta.publish(p1, entries(blocks[:3]))
    await cluster.kvmeta.publish(p2, entries(blocks[:1]))
    assert (await cluster.route(prompt)).prefill.id == p0  # least loaded: all equal, smallest id

    assert (await cluster.policy("prefix_aware")).policy == "prefix_aware"
    route = await cluster.route(prompt)
    assert (route.prefill.id, route.cached_blocks, route.policy) == (p1, 3, "prefix_aware")
    other = await cluster.route(list(range(500, 570)))  # nobody holds it
    assert (other.prefill.id, other.cached_blocks) == (p2, 0)  # p0 and p1 each took a prompt: p2 is idlest


async def test_policy_switches_at_run_time_and_unknown_names_are_refused(cluster: Cluster):
    info = await cluster.scheduler.call("GET", "/v1/policy", into=PolicyInfo)
    assert info.policy == "least_loaded" and info.available[:3] == ["round_robin", "least_loaded", "prefix_aware"]
    assert (await cluster.policy("round_robin")).policy == "round_robin"
    assert (await cluster.view()).policy == "round_robin"
    with pytest.raises(RemoteError) as unknown:
        await cluster.policy("fastest")
    assert unknown.value.status == 400
    assert "fastest" in unknown.value.message and "prefix_aware" in unknown.value.message
    assert (await cluster.scheduler.call("GET", "/v1/policy", into=PolicyInfo)).policy == "round_robin"


async def test_an_unknown_model_is_404_and_a_known_one_without_live_engines_is_503(cluster: Cluster):
    with pytest.raises(RemoteError) as unknown:  # no engine has ever served it: the caller's mistake
        await cluster.route()
    assert (unknown.value.status, unknown.value.type) == (404, "model_not_found")
    assert cluster.model in unknown.value.message
    p0 = engine_id(cluster, "p0")
    await cluster.register(p0, "both")
    with pytest.raises(RemoteError) as excluded:
        await cluster.route(exclude=[p0])
    assert excluded.value.status == 503 and "excluded" in excluded.value.message
    await cluster.deregister(p0)
    await cluster.until(lambda view: p0 not in ids(view))
    with pytest.raises(RemoteError) as down:  # its engines are gone, for now: the cluster's trouble
        await cluster.route()
    assert (down.value.status, down.value.type) == (503, "no_engine")
    assert cluster.model in down.value.message


@pytest.mark.parametrize("body", [
    b"{not json",
    b'{"prompt_token_ids": [1, 2]}',                        # no model
    b'{"model": "m", "prompt_token_ids": [-1]}',             # not a token id
    b'{"model": "m", "exclude": ["has space"]}',             # not an engine id
    b'{"model": "m", "priority": 3}',                        # unknown field
    b'{"model": "m", "prompt_token_ids": [' + b"1," * MAX_PROMPT_TOKENS + b'1]}',  # one token too many
], ids=["malformed", "no-model", "negative-token", "bad-exclude", "unknown-field", "too-long"])
async def test_bad_route_bodies_are_400(scheduler: Child, body: bytes):
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session, \
            session.post(scheduler.url + "/v1/route", data=body, headers=headers) as answer:
        assert answer.status == 400 and (await answer.json())["error"]["code"] == 400


async def test_a_route_asked_before_the_first_snapshot_waits_for_it_then_is_a_503(tmp_path):
    """A scheduler that does not know the engines yet (just started; requests that waited for it on a
    held socket arrive at once) waits for kvmeta's first snapshot, and without one within the wait it
    is unavailable (503), never a 404 for a model it simply has not seen yet."""
    port = free_port()
    child = service_child("scheduler", tmp_path, f"http://127.0.0.1:{port}", {
        "KVMESH_SCHEDULER_PORT": str(port), "KVMESH_KVMETA_URL": f"http://127.0.0.1:{free_port()}",  # nothing there
        "KVMESH_TOKEN": TOKEN})
    child.start()
    try:
        await asyncio.to_thread(_until_listening, port)
        async with ServiceClient(child.url, token=TOKEN, timeout=30, retries=0) as scheduler:
            started = time.monotonic()
            with pytest.raises(RemoteError) as unavailable:
                await scheduler.call("POST", "/v1/route", {"model": "tiny", "prompt_token_ids": [1, 2]}, into=Route)
        assert unavailable.value.status == 503 and "snapshot" in unavailable.value.message
        assert time.monotonic() - started >= 4.0  # it waited for one
    finally:
        child.stop()


def _until_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_in_use("127.0.0.1", port):
        assert time.monotonic() < deadline, "the scheduler never listened"
        time.sleep(0.05)
