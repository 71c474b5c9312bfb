"""Property-based requests (schemathesis) against every service's published API, docs/api/*.openapi.json
(what each serves at GET /openapi.json), on one small real cluster: whatever the request, no 5xx and
no hang; a refusal is a 4xx. The example budget per operation is bounded so that CI can run it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgpack
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings

from ..conftest import TOKEN, cluster_name
from ..integration.admission_fixtures import MODEL, Cluster, idle, launch, ready, start_cluster, wait_until_idle

API = Path(__file__).resolve().parents[2] / "docs" / "api"
KEY = "sk-fuzz"
EXAMPLES = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
# Generated prefills may hold KV and generated reservations hold blocks, each until its lease ends.
LEASES = {"KVMESH_ENGINE_KV_LEASE_MS": "2000", "KVMESH_ENGINE_KV_TIMEOUT_MS": "2000"}
STREAMS = r"/watch$"  # endless event streams: a call would only end at its timeout


# msgpack has no integers past 64 bits: the generator's larger ones go as strings (still refused, as wrong types)
@schemathesis.serializer("application/msgpack")
def _msgpack(ctx: Any, value: Any) -> bytes:
    return msgpack.packb(_fits(value))


def _fits(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
        return str(value)
    if isinstance(value, list):
        return [_fits(v) for v in value]
    if isinstance(value, dict):
        return {k: _fits(v) for k, v in value.items()}
    return value


def operations(service: str) -> list[Any]:
    """Each operation of the service's published description (endless streams left out)."""
    schema = schemathesis.openapi.from_path(API / f"{service}.openapi.json").exclude(path_regex=STREAMS)
    return [pytest.param(result.ok(), id=result.ok().label) for result in schema.get_all_operations()]


def fuzz(operation: Any, base_url: str, token: str = TOKEN) -> None:
    """The operation's generated requests, each checked by `call`. Hypothesis drives it here rather
    than schemathesis' pytest plugin, whose per-operation tests do not run under pytest-xdist."""
    @EXAMPLES
    @given(case=operation.as_strategy())
    def each(case: Any) -> None:
        call(case, base_url, token)
    each()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with ExitStack() as exits:
        run_dir = tmp_path_factory.mktemp("fuzz")
        found = start_cluster(exits, run_dir, redis_url, cluster_name(request), {"engine-c0": "both"},
                              engine_env=LEASES, KVMESH_API_KEY=KEY, KVMESH_ADMISSION_REQUESTS_PER_S="0")
        found.predictor = ready(exits, launch("predictor", run_dir))
        yield found


def call(case: Any, base_url: str, token: str = TOKEN) -> None:
    response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    said = f"{case.as_curl_command()}\n-> {response.status_code} {response.content[:400]!r}"
    assert response.status_code < 500, said
    if response.status_code >= 400:  # a structured refusal: kvmesh's or OpenAI's error object, with a message
        body = response.json() if response.content[:1] == b"{" else msgpack.unpackb(response.content)  # per Accept
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], said


@pytest.mark.parametrize("operation", operations("kvmeta"))
def test_kvmeta(operation, kvmeta):
    """On a kvmeta of its own (its generated registrations would be the cluster's engines), whose
    namespace is checked for consistency after each operation's examples."""
    fuzz(operation, kvmeta.url)


@pytest.mark.parametrize("operation", operations("scheduler"))
def test_scheduler(operation, cluster):
    fuzz(operation, cluster.scheduler.url)


@pytest.mark.parametrize("operation", operations("predictor"))
def test_predictor(operation, cluster):
    fuzz(operation, cluster.predictor.url)


@pytest.mark.parametrize("operation", operations("engine"))
def test_engine(operation, cluster):
    fuzz(operation, cluster.engines["engine-c0"].url)


@pytest.mark.parametrize("operation", operations("admission"))
def test_admission(operation, cluster):
    fuzz(operation, cluster.admission.url, token=KEY)


async def test_every_service_still_serves_and_the_engine_holds_nothing(cluster):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    answer = requests.post(cluster.admission.url + "/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert idle(await wait_until_idle(cluster.engines["engine-c0"].url, timeout=10))


# Open on every service by design: probes, Prometheus' scrape and the API's description. Admission's
# OpenAI routes take API keys instead of the service token.
OPEN = {"/health", "/ready", "/metrics", "/openapi.json"}
OPENAI_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}"}


@pytest.mark.parametrize("service", ["kvmeta", "scheduler", "predictor", "engine", "admission"])
def test_every_route_but_the_open_ones_refuses_a_caller_without_the_right_credential(service, cluster):
    """Each operation of the published description, called with no credential and with a wrong one,
    before any body is read: the service token's routes answer 401 and 403, admission's OpenAI routes
    401 (API keys), and nothing else answers at all."""
    base = cluster.engines["engine-c0"].url if service == "engine" else getattr(cluster, service).url
    paths = json.loads((API / f"{service}.openapi.json").read_text())["paths"]
    refusals = {}
    for path, methods in paths.items():
        if path in OPEN:
            continue
        for method in methods:
            url = base + re.sub(r"\{[^}]+\}", "x", path)
            wrong = "sk-wrong" if path in OPENAI_ROUTES else "not-the-cluster-token"
            refusals[method.upper(), path] = tuple(
                requests.request(method.upper(), url, headers=headers, timeout=10).status_code
                for headers in ({}, {"Authorization": f"Bearer {wrong}"}))
    assert refusals and all(codes == ((401, 401) if path in OPENAI_ROUTES else (401, 403))
                            for (_, path), codes in refusals.items()), refusals
