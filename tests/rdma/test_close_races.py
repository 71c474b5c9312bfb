"""A CONNECT that finishes while its endpoint closes: no queue pair survives the close, on either
side. The peer here is a bare socket speaking the tcp backend's handshake, so the test decides when
each message goes out (tcp and shm share that handshake)."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.tcp.wire import HEADER, Kind, PeerClosed, header, recv_exact
from kvmesh.libs.rdma.work import QueuePairError

from .conftest import TOKEN


@pytest.fixture(params=["tcp", "shm"])
async def endpoint(request):
    made = open_endpoint(request.param, TOKEN)
    await made.start()
    yield made
    await made.close()


def send_message(sock: socket.socket, kind: Kind, body: dict) -> None:
    payload = msgpack.packb(body)
    sock.sendall(header(kind, n=len(payload)) + payload)


def frames_until_closed(sock: socket.socket) -> list[tuple[Kind, bytes]]:
    """Every frame the endpoint sends until it ends the connection."""
    frames = []
    sock.settimeout(5)
    try:
        while True:
            kind, _, _, _, _, n = HEADER.unpack(recv_exact(sock, HEADER.size))
            frames.append((Kind(kind), bytes(recv_exact(sock, n))))
    except (PeerClosed, ConnectionResetError):
        return frames
    except TimeoutError:
        raise AssertionError(f"the endpoint keeps the connection open after {[k.name for k, _ in frames]}") from None


async def test_a_hello_arriving_after_close_gets_no_queue_pair(endpoint):
    host, port = endpoint.address.rsplit(":", 1)
    loop = asyncio.get_running_loop()
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        await asyncio.sleep(0.1)  # the accept thread takes the connection and waits for HELLO
        await endpoint.close()
        send_message(sock, Kind.HELLO, {"token": TOKEN, "backend": endpoint.backend})
        frames = await loop.run_in_executor(None, frames_until_closed, sock)
    finally:
        sock.close()
    # Refused, or reset by the closing listener had it not been accepted yet: never welcomed.
    assert [kind for kind, _ in frames] in ([Kind.REFUSE], [])
    if frames:
        assert msgpack.unpackb(frames[0][1])["reason"] == "the endpoint is closed"
    await asyncio.sleep(0)  # what a handshake thread handed to the loop has run
    assert not endpoint.queue_pairs


async def test_a_welcome_arriving_after_close_fails_the_connect_and_ends_the_connection(endpoint):
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        connecting = asyncio.create_task(endpoint.connect("127.0.0.1:%d" % listener.getsockname()[1], timeout=10))
        sock, _ = await loop.run_in_executor(None, listener.accept)
    try:
        sock.settimeout(10)
        kind, _, _, _, _, n = HEADER.unpack(await loop.run_in_executor(None, recv_exact, sock, HEADER.size))
        assert kind == Kind.HELLO
        await loop.run_in_executor(None, recv_exact, sock, n)
        await endpoint.close()
        send_message(sock, Kind.WELCOME, endpoint.welcome())
        with pytest.raises(QueuePairError, match="closed while connecting"):
            await connecting
        frames = await loop.run_in_executor(None, frames_until_closed, sock)
    finally:
        sock.close()
    assert [kind for kind, _ in frames] == [Kind.BYE]
    assert not endpoint.queue_pairs
