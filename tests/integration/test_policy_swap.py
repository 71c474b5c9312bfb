"""Swapping a policy service while requests flow (issue 11, docs/deploy.md "Swapping a policy service"):
admission's length predictor is replaced by a third-party service speaking the same API
(examples/policy_services/ratio_predictor.py, nothing of kvmesh in it), then its scheduler by a second
scheduler with another routing policy, with no failed request and no restart; a service that cannot
serve is refused and changes nothing. Real processes on loopback."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.infra.local.processes import Child, free_port
from kvmesh.libs.controlplane import RemoteError, ServiceClient

from ..conftest import TOKEN, cluster_name
from .admission_fixtures import MODEL, launch, ready, start_cluster, wait_until_idle

KEY = "sk-swap-test"
RATIO_PREDICTOR = Path(__file__).parents[2] / "examples" / "policy_services" / "ratio_predictor.py"


def counter(url: str, name: str) -> float:
    """A metric's samples of that name, summed over their labels."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def ratio_predictor(run_dir: Path, token: str = TOKEN) -> Child:
    """examples/policy_services/ratio_predictor.py as a process of its own (not yet waited on)."""
    port = free_port()
    child = Child("ratio-predictor", [sys.executable, str(RATIO_PREDICTOR), "--port", str(port)],
                  run_dir / "logs" / "ratio-predictor.log", env={"KVMESH_TOKEN": token}, url=f"http://127.0.0.1:{port}")
    child.start()
    return child


@pytest.fixture(scope="module")
def swappable(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest):
    """One colocated engine behind the built-in predictor and scheduler, and their replacements waiting."""
    run_dir = tmp_path_factory.mktemp("swap")
    with ExitStack() as exits:
        builtin = ready(exits, launch("predictor", run_dir, KVMESH_PREDICTOR_ADAPTIVE="false"))
        cluster = start_cluster(exits, run_dir, redis_url, cluster_name(request), {"engine-0": "both"},
                                KVMESH_API_KEY=KEY, KVMESH_ADMISSION_PREDICTOR_URL=builtin.url,
                                KVMESH_ADMISSION_REQUESTS_PER_S="0")
        replacement = ready(exits, ratio_predictor(run_dir))
        scheduler = ready(exits, launch("scheduler", run_dir, KVMESH_KVMETA_URL=cluster.kvmeta.url,
                                        KVMESH_SCHEDULER_POLICY="round_robin"))
        yield cluster, builtin, replacement, scheduler


async def upstreams(admission_url: str, change: dict | None = None) -> dict:
    async with ServiceClient(admission_url, token=TOKEN, retries=0, timeout=30) as client:
        return await client.call("PUT" if change is not None else "GET", "/v1/upstreams", change, into=dict)


async def flow(admission_url: str, stop: asyncio.Event, results: list, clients: int = 3) -> None:
    """Requests one after another from each of `clients` until `stop`; each outcome into `results`."""
    async def client_loop(client: openai.AsyncOpenAI, n: int) -> None:
        while not stop.is_set():
            try:
                reply = await client.completions.create(model=MODEL, prompt=f"client {n} says hello", max_tokens=4,
                                                        extra_body={"ignore_eos": True})
                results.append(reply.usage.completion_tokens)
            except openai.APIError as exc:
                results.append(exc)

    async with openai.AsyncOpenAI(base_url=admission_url + "/v1", api_key=KEY, max_retries=0) as client:
        await asyncio.gather(*(client_loop(client, n) for n in range(clients)))


async def served_since(results: list, count: int, timeout: float = 60.0) -> None:
    start = len(results)
    deadline = asyncio.get_running_loop().time() + timeout
    while len(results) < start + count and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def routes(scheduler_url: str) -> float:
    return counter(scheduler_url, "kvmesh_scheduler_routes_total")


async def test_predictor_and_scheduler_are_swapped_while_requests_flow(swappable):
    cluster, builtin, replacement, scheduler = swappable
    admission = cluster.admission.url
    assert await upstreams(admission) == {"scheduler_url": cluster.scheduler.url, "predictor_url": builtin.url}
    results: list = []
    stop = asyncio.Event()
    load = asyncio.create_task(flow(admission, stop, results))
    try:
        await served_since(results, 6)
        assert await upstreams(admission, {"predictor_url": replacement.url}) == \
            {"scheduler_url": cluster.scheduler.url, "predictor_url": replacement.url}
        await asyncio.sleep(1.0)  # predict calls begun before the swap have ended (predict_timeout_s 0.5)
        builtin_after_swap = counter(builtin.url, "kvmesh_predictor_predictions_total")
        await served_since(results, 6)

        assert (await upstreams(admission, {"scheduler_url": scheduler.url}))["scheduler_url"] == scheduler.url
        await asyncio.sleep(1.0)
        routed_by_old = routes(cluster.scheduler.url)
        await served_since(results, 6)
    finally:
        stop.set()
        await load

    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures and len(results) >= 18 and set(results) == {4}
    assert counter(builtin.url, "kvmesh_predictor_predictions_total") == builtin_after_swap
    assert counter(replacement.url, "ratio_predictor_predictions_total") >= 6
    assert counter(replacement.url, "ratio_predictor_observations_total") >= 1
    assert routes(cluster.scheduler.url) == routed_by_old
    assert routes(scheduler.url) >= 6
    assert counter(admission, "kvmesh_admission_upstream_swaps_total") == 2
    for engine in cluster.engines.values():
        state = await wait_until_idle(engine.url)
        assert state["free_blocks"] == state["total_blocks"]

    # and back: the built-in services were never restarted, so they serve again at once
    await upstreams(admission, {"predictor_url": builtin.url, "scheduler_url": cluster.scheduler.url})
    async with openai.AsyncOpenAI(base_url=admission + "/v1", api_key=KEY, max_retries=0) as client:
        reply = await client.completions.create(model=MODEL, prompt="back home", max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert counter(builtin.url, "kvmesh_predictor_predictions_total") == builtin_after_swap + 1


@pytest.mark.parametrize("change, message", [
    ({"predictor_url": "http://127.0.0.1:9"}, "is not a ready service"),
    ({"scheduler_url": None}, "Expected `str`, got `None`"),
    ({"scheduler_url": 8102}, "Expected `str`"),
    ({"predictor_url": "predictor:8101"}, "Expected `str` matching regex"),
    ({"predictor": "rlp"}, "unknown field"),
])
async def test_a_change_that_cannot_be_served_is_refused_and_changes_nothing(swappable, change, message):
    cluster = swappable[0]
    before = await upstreams(cluster.admission.url)
    with pytest.raises(RemoteError) as refused:
        await upstreams(cluster.admission.url, change)
    assert refused.value.status == 400 and message in refused.value.message
    assert await upstreams(cluster.admission.url) == before


async def test_a_service_lacking_an_operation_admission_calls_is_refused(swappable):
    cluster, _, replacement, scheduler = swappable
    before = await upstreams(cluster.admission.url)
    with pytest.raises(RemoteError) as refused:  # a scheduler is no predictor ...
        await upstreams(cluster.admission.url, {"predictor_url": scheduler.url})
    assert "POST /v1/observe, POST /v1/predict" in refused.value.message
    with pytest.raises(RemoteError) as refused:  # ... and a predictor no scheduler; a valid half does not go alone
        await upstreams(cluster.admission.url, {"predictor_url": replacement.url, "scheduler_url": replacement.url})
    assert "GET /v1/cluster, POST /v1/route" in refused.value.message
    assert await upstreams(cluster.admission.url) == before


async def test_predicting_can_be_turned_off_and_on(swappable):
    cluster, builtin, _, _ = swappable
    admission = cluster.admission.url
    assert (await upstreams(admission, {"predictor_url": None}))["predictor_url"] is None
    before = counter(builtin.url, "kvmesh_predictor_predictions_total")
    async with openai.AsyncOpenAI(base_url=admission + "/v1", api_key=KEY, max_retries=0) as client:
        await client.completions.create(model=MODEL, prompt="unpredicted", max_tokens=2)
        assert counter(builtin.url, "kvmesh_predictor_predictions_total") == before
        await upstreams(admission, {"predictor_url": builtin.url + "/"})  # the same service, written another way
        await client.completions.create(model=MODEL, prompt="predicted", max_tokens=2)
    assert counter(builtin.url, "kvmesh_predictor_predictions_total") == before + 1
    assert (await upstreams(admission))["predictor_url"] == builtin.url
