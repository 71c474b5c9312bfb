"""libs/controlplane: two real services on loopback sockets, talking through ServiceClient."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import msgspec
import pytest
from aiohttp import web

from kvmesh.infra.local.processes import free_port
from kvmesh.libs.controlplane import (RemoteError, Service, ServiceClient, ServiceConfig, ServiceUnreachable,
                                      ValidationFailed)

TOKEN = "s3cret"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Item(msgspec.Struct):
    name: str
    count: int


class Seen(msgspec.Struct):
    traceparent: str | None


class Relayed(msgspec.Struct):
    front: str | None
    back: str | None


async def serve(service: Service) -> tuple[str, web.AppRunner]:
    runner = web.AppRunner(service.build())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", service.config.port).start()
    return f"http://127.0.0.1:{service.config.port}", runner


@pytest.fixture
async def back() -> AsyncIterator[tuple[str, Counter]]:
    calls: Counter = Counter()
    service = Service("back", ServiceConfig(port=free_port(), token=TOKEN, max_body_bytes=1024))

    @service.route("GET", "/v1/echo", response=Seen)
    async def echo(request: web.Request) -> Seen:
        return Seen(traceparent=request.headers.get("traceparent"))

    @service.route("POST", "/v1/items", body=Item, response=Item)
    async def items(request: web.Request, body: Item) -> Item:
        if body.count < 0:
            raise ValidationFailed("count must not be negative")
        return Item(name=body.name.upper(), count=body.count + 1)

    @service.route("GET", "/v1/flaky", response=Seen)
    @service.route("POST", "/v1/flaky", response=Seen)
    async def flaky(request: web.Request) -> Seen:
        calls[request.method] += 1
        if calls[request.method] <= 2:
            raise web.HTTPServiceUnavailable()
        return Seen(traceparent=None)

    @service.route("GET", "/v1/broken")
    async def broken(request: web.Request) -> None:
        raise RuntimeError("internal detail that must not leak")

    url, runner = await serve(service)
    yield url, calls
    await runner.cleanup()


async def test_trace_context_flows_through_a_service_to_the_next(back):
    back_url, _ = back
    front = Service("front", ServiceConfig(port=free_port()))
    client = ServiceClient(back_url, token=TOKEN)

    @front.route("GET", "/v1/relay", response=Relayed, internal=False)
    async def relay(request: web.Request) -> Relayed:
        seen = await client.call("GET", "/v1/echo", into=Seen)
        return Relayed(front=request.headers.get("traceparent"), back=seen.traceparent)

    front_url, runner = await serve(front)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(front_url + "/v1/relay", headers={"traceparent": TRACEPARENT}) as response:
                relayed = msgspec.json.decode(await response.read(), type=Relayed)
        assert relayed.front == TRACEPARENT
        assert relayed.back.split("-")[1] == TRACEPARENT.split("-")[1]  # same trace id on the next hop
    finally:
        await client.close()
        await runner.cleanup()


async def test_msgpack_round_trip_with_validation(back):
    url, _ = back
    async with ServiceClient(url, token=TOKEN) as client:
        assert await client.call("POST", "/v1/items", Item("kv", 1), into=Item) == Item("KV", 2)
        with pytest.raises(RemoteError) as invalid:
            await client.call("POST", "/v1/items", {"name": "kv", "count": "one"}, into=Item)
        assert (invalid.value.status, invalid.value.type) == (400, "validation_error")
        with pytest.raises(RemoteError) as negative:
            await client.call("POST", "/v1/items", Item("kv", -1), into=Item)
        assert negative.value.message == "count must not be negative"


async def test_json_in_json_out_and_accept_decides(back):
    url, _ = back
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/items", json={"name": "a", "count": 0}, headers=auth) as response:
            assert response.content_type == "application/json" and await response.json() == {"name": "A", "count": 1}
        async with http.post(url + "/v1/items", json={"name": "a", "count": 0},
                             headers={**auth, "Accept": "application/msgpack"}) as response:
            assert msgspec.msgpack.decode(await response.read()) == {"name": "A", "count": 1}


async def test_idempotent_calls_are_retried_and_others_are_not(back):
    url, calls = back
    async with ServiceClient(url, token=TOKEN, retries=3, backoff=0.01) as client:
        await client.call("GET", "/v1/flaky", into=Seen)
        assert calls["GET"] == 3
        with pytest.raises(RemoteError) as once:
            await client.call("POST", "/v1/flaky", into=Seen)
        assert once.value.status == 503 and calls["POST"] == 1
        await client.call("POST", "/v1/flaky", into=Seen, idempotent=True)
        assert calls["POST"] == 3


async def test_no_answer_is_service_unreachable_after_bounded_retries():
    async with ServiceClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff=0.01) as client:
        with pytest.raises(ServiceUnreachable, match="after 3 attempt"):
            await client.call("GET", "/v1/anything")


@pytest.mark.parametrize("framing", [b"Content-Length: 100\r\n", b"Transfer-Encoding: chunked\r\n"])
async def test_a_stream_cut_midway_is_service_unreachable(framing):
    """A server that dies mid-answer (kill -9 of an engine while it streams) leaves the body short of
    what its framing promised: the caller gets ServiceUnreachable, like any other broken stream."""
    first = msgpack.packb({"name": "a", "count": 1})
    partial = first if b"Content-Length" in framing else b"%x\r\n%s\r\n" % (len(first), first)

    async def answer_then_die(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n" + framing + b"\r\n" + partial)
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(answer_then_die, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    got: list[Item] = []
    async with server, ServiceClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(ServiceUnreachable, match="broke"):
            async for item in client.frames("/v1/generate", {}, Item):
                got.append(item)
    assert got == [Item("a", 1)]


async def test_unexpected_failure_is_a_structured_500_without_internals(back):
    url, _ = back
    async with ServiceClient(url, token=TOKEN, retries=0) as client:
        with pytest.raises(RemoteError) as failed:
            await client.call("GET", "/v1/broken")
    assert failed.value.status == 500 and failed.value.type == "internal_error"
    assert "internal detail" not in failed.value.message


async def test_oversize_body_is_413(back):
    url, _ = back
    async with ServiceClient(url, token=TOKEN) as client:
        with pytest.raises(RemoteError) as large:
            await client.call("POST", "/v1/items", Item("x" * 5000, 1), into=Item)
    assert (large.value.status, large.value.type) == (413, "payload_too_large")


async def test_metrics_count_requests_per_route_and_status(back):
    url, _ = back
    async with ServiceClient(url, token=TOKEN) as client:
        for _ in range(3):
            await client.call("POST", "/v1/items", Item("a", 1), into=Item)
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
            text = await response.text()
    assert 'kvmesh_http_requests_total{method="POST",route="/v1/items",status="200"} 3.0' in text
    assert 'kvmesh_http_request_duration_seconds_count{method="POST",route="/v1/items"} 3.0' in text
