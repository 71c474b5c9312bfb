"""Bad input gets a clear structured error and changes nothing."""

from __future__ import annotations

import aiohttp
import msgspec
import pytest

from kvmesh.libs.kvmeta.client import KvmetaClient

from ..conftest import TOKEN, Kvmeta
from ..factories import worker_info

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MSGPACK = {**AUTH, "Content-Type": "application/msgpack", "Accept": "application/msgpack"}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def error_of(response: aiohttp.ClientResponse) -> dict:
    assert response.content_type in ("application/json", "application/msgpack")
    raw = await response.read()
    body = msgspec.msgpack.decode(raw) if response.content_type == "application/msgpack" else msgspec.json.decode(raw)
    assert set(body["error"]) == {"type", "message", "code"} and body["error"]["code"] == response.status
    return body["error"]


def registration(**changes) -> dict:
    body = {"worker": msgspec.to_builtins(worker_info("p0")), "ttl_ms": 5000}
    body["worker"].update(changes)
    return body


@pytest.mark.parametrize("raw, status, kind", [
    (b"\xc1\xff\x00", 400, "invalid_request"),                                   # not msgpack at all
    (msgspec.msgpack.encode([1, 2, 3]), 400, "validation_error"),                # wrong shape
    (msgspec.msgpack.encode(registration(role="janitor")), 400, "validation_error"),
    (msgspec.msgpack.encode(registration(id="has space")), 400, "validation_error"),
    (msgspec.msgpack.encode(registration(geometry={"block_size": "16"})), 400, "validation_error"),
    (msgspec.msgpack.encode({"worker": msgspec.to_builtins(worker_info("p0")), "ttl_ms": 1}), 400, "validation_error"),
    (b"", 400, "invalid_request"),
])
async def test_malformed_or_mistyped_registration_is_refused(kvmeta: Kvmeta, client: KvmetaClient, http, raw, status,
                                                             kind):
    async with http.post(kvmeta.url + "/v1/workers", data=raw, headers=MSGPACK) as response:
        assert response.status == status
        error = await error_of(response)
        assert error["type"] == kind and error["message"]
    assert await client.workers() == []


async def test_validation_error_says_where(kvmeta: Kvmeta, http):
    async with http.post(kvmeta.url + "/v1/cache/lookup", json={"node_ids": ["ok", 5]}, headers=AUTH) as response:
        assert response.status == 400
        assert "$.node_ids[1]" in (await error_of(response))["message"]


async def test_oversize_body_is_413_and_changes_nothing(kvmeta: Kvmeta, client: KvmetaClient, http):
    await client.register(worker_info("p0"))
    huge = msgspec.msgpack.encode({"engine": "p0", "entries": [{"node_id": f"n{i}", "tier": "device", "size": 1}
                                                               for i in range(300_000)]})
    assert len(huge) > 8 * 1024 * 1024
    async with http.post(kvmeta.url + "/v1/cache/publish", data=huge, headers=MSGPACK) as response:
        assert response.status == 413
        assert (await error_of(response))["type"] == "payload_too_large"
    assert await client.lookup(["n0"]) == []


async def test_missing_token_is_401_and_wrong_token_is_403(kvmeta: Kvmeta, client: KvmetaClient, http):
    body = msgspec.msgpack.encode(registration())
    async with http.post(kvmeta.url + "/v1/workers", data=body,
                         headers={"Content-Type": "application/msgpack"}) as response:
        assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert (await error_of(response))["type"] == "unauthorized"
    async with http.post(kvmeta.url + "/v1/workers", data=body,
                         headers={**MSGPACK, "Authorization": "Bearer not-the-token"}) as response:
        assert response.status == 403
    assert await client.workers() == []


async def test_health_metrics_and_openapi_need_no_token(kvmeta: Kvmeta, http):
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        async with http.get(kvmeta.url + path) as response:
            assert response.status == 200, path
    async with http.get(kvmeta.url + "/openapi.json") as response:
        spec = await response.json()
    assert spec["paths"]["/v1/cache/lookup"]["post"]["security"] == [{"serviceToken": []}]
    assert "PrefixLookup" in spec["components"]["schemas"]


async def test_bad_path_and_query_parameters_are_400(kvmeta: Kvmeta, http):
    async with http.get(kvmeta.url + "/v1/blocks", params={"limit": "lots"}, headers=AUTH) as response:
        assert response.status == 400 and "limit" in (await error_of(response))["message"]
    async with http.put(kvmeta.url + "/v1/workers/has%20space/heartbeat", json={}, headers=AUTH) as response:
        assert response.status == 400


async def test_unknown_endpoint_and_method_are_structured_errors(kvmeta: Kvmeta, http):
    async with http.get(kvmeta.url + "/v1/nothing-here", headers=AUTH) as response:
        assert response.status == 404 and (await error_of(response))["type"] == "not_found"
    async with http.delete(kvmeta.url + "/v1/cache/lookup", headers=AUTH) as response:
        assert response.status == 405 and "POST" in (await error_of(response))["message"]


async def test_errors_answer_in_json_to_curl(kvmeta: Kvmeta, http):
    async with http.post(kvmeta.url + "/v1/workers", data=b'{"worker": ', headers=AUTH) as response:
        assert response.status == 400 and response.content_type == "application/json"
        assert "malformed JSON" in (await error_of(response))["message"]
