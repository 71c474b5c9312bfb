"""Property-based bytes against kvmesh's byte-level parsers (issue 29): the msgpack frame stream an engine
sends admission, the tcp and shm backends' frames after a valid handshake and raw bytes before one,
and KVDirect's CONNECT/COMPLETE/ACK messages with their tensor descriptors. Whatever arrives, the
parser refuses it cleanly (a typed error, or the connection closed), allocates a bounded amount for
it, and the endpoint goes on serving a correct peer."""

from __future__ import annotations

import asyncio
import socket
import threading
import tracemalloc
from collections.abc import Iterator

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvmesh.libs.controlplane import RemoteError, ServiceClient, ServiceUnreachable
from kvmesh.libs.rdma.backends import open_endpoint, unavailable_reason
from kvmesh.libs.rdma.kvdirect.descriptor import MAX_PIECES
from kvmesh.libs.rdma.kvdirect.messages import Connect, _decoder
from kvmesh.libs.rdma.shm.shared import shared_buffer
from kvmesh.libs.rdma.tcp.wire import HEADER, Kind, header, recv_exact
from kvmesh.libs.rdma.work import Segments

EXAMPLES = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
TOKEN = "fuzz-cluster-token"
BOUNDED_BYTES = 96 << 20  # a READ's segment table may be 64 MiB (wire.MAX_SEGMENTS); nothing may pass that by far
CLAIMS = st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1),
                   st.sampled_from([2**20, 2**22, 2**22 + 1, 2**26, 2**30, 2**40, 2**63]))


# -- the msgpack frame stream (engine -> admission) ----------------------------------------------


class Tick(msgspec.Struct):
    request_id: str
    token_ids: list[int]


VALID = msgpack.packb({"request_id": "r", "token_ids": [1, 2]})
HOSTILE_STREAMS = st.one_of(
    st.binary(max_size=512),
    st.lists(st.sampled_from([VALID, b"\xc1", b"\xc6\xff\xff\xff\xff", b"\xdd\x7f\xff\xff\xff",
                              msgpack.packb({"request_id": 5}), msgpack.packb([1, 2]), b"\x81\x91\x00\x00",
                              msgpack.packb({"request_id": "r", "token_ids": ["x"]})]), max_size=6).map(b"".join),
)


async def _frames_of(body: bytes) -> list[Tick]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server, ServiceClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}") as client:
        return [tick async for tick in client.frames("/v1/generate", {}, Tick)]


@EXAMPLES
@given(body=HOSTILE_STREAMS)
def test_a_hostile_frame_stream_is_refused_as_invalid_never_crashes(body: bytes):
    try:
        ticks = asyncio.run(asyncio.wait_for(_frames_of(body), 10))
    except RemoteError as exc:
        assert (exc.status, exc.type) == (502, "invalid_response")
        return
    except ServiceUnreachable:
        return
    assert all(isinstance(tick, Tick) for tick in ticks)


# -- the tcp and shm backends' wire --------------------------------------------------------------


class Owner:
    """A started endpoint that owns one registered region, its event loop on a thread of its own."""

    def __init__(self, backend: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.endpoint = open_endpoint(backend, TOKEN)
        self.address = self.run(self.endpoint.start())
        self.data = shared_buffer(1 << 16)
        self.data[:] = np.random.default_rng(0).integers(0, 256, self.data.size, dtype=np.uint8)
        self.region = self.run(self._register())

    async def _register(self):
        return self.endpoint.register(self.data)

    def run(self, coroutine, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.endpoint.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module", params=["tcp", "shm"])
def owner(request) -> Iterator[Owner]:
    reason = unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} backend unavailable here: {reason}")
    made = Owner(request.param)
    yield made
    made.close()


def _connect(owner: Owner) -> socket.socket:
    """A raw connection that has passed the handshake as a peer of the owner's backend would."""
    host, _, port = owner.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    body = msgpack.packb({"token": TOKEN, "backend": owner.endpoint.backend})
    sock.sendall(header(Kind.HELLO, n=len(body)) + body)
    kind, *_, n = HEADER.unpack(recv_exact(sock, HEADER.size))
    assert kind == Kind.WELCOME
    recv_exact(sock, n)
    return sock


def _drain(sock: socket.socket, seconds: float = 0.3) -> None:
    """Read what the owner answers until it closes the connection or falls quiet, then hang up."""
    sock.settimeout(seconds)
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
    sock.close()


# Frames that claim more than a peer may: what the bounds in wire.py refuse before allocating.
OVERCLAIMS = [[(Kind.READ, 0, -1, 1, 2**24, b"")], [(Kind.WRITE, 0, -1, 1, 2**24, b"")],
              [(Kind.SEND, 0, 0, 1, 2**27, b"")]]
FRAMES = st.lists(st.tuples(st.one_of(st.sampled_from([Kind.READ, Kind.WRITE, Kind.SEND, Kind.READ_DATA, Kind.REGION]),
                                      st.sampled_from(list(Kind)), st.integers(0, 255)), st.integers(0, 255),
                            st.one_of(st.just(-1), st.integers(0, 2**32 - 1)), st.integers(0, 2**64 - 1), CLAIMS,
                            st.binary(max_size=256)), min_size=1, max_size=3)


def _still_serves(owner: Owner) -> None:
    """A correct peer connects and reads the region's bytes back."""
    async def read_back() -> bytes:
        peer = open_endpoint(owner.endpoint.backend, TOKEN)
        await peer.start()
        try:
            mine = peer.register(shared_buffer(256))
            qp = await peer.connect(owner.address, timeout=5)
            await qp.read(mine, Segments.one(0, owner.region.addr + 128, 256), owner.region.rkey, timeout=5)
            await qp.close()
            return bytes(mine.view[:256])
        finally:
            await peer.close()

    assert owner.run(read_back()) == bytes(owner.data[128:384])


def test_hostile_frames_after_the_handshake_are_refused_within_bounds(owner: Owner):
    tracemalloc.start()
    try:
        @EXAMPLES
        @given(frames=FRAMES)
        @example(frames=OVERCLAIMS[0])
        @example(frames=OVERCLAIMS[1])
        @example(frames=OVERCLAIMS[2])
        def each(frames) -> None:
            sock = _connect(owner)
            for kind, status, key, wr_id, n, tail in frames:
                key = owner.region.rkey if key == -1 else key
                try:
                    sock.sendall(HEADER.pack(kind, status, 0, key, wr_id, n) + tail)
                except OSError:  # the owner already dropped us: refused
                    break
            _drain(sock)

        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        each()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < BOUNDED_BYTES, f"{peak / 2**20:.0f} MiB allocated for hostile frames"
    _still_serves(owner)


@EXAMPLES
@given(garbage=st.binary(min_size=1, max_size=512))
def test_bytes_before_a_handshake_are_refused(owner: Owner, garbage: bytes):
    host, _, port = owner.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        sock.sendall(garbage)
    except OSError:
        pass
    _drain(sock, seconds=0.05)


def test_the_owner_serves_after_pre_handshake_garbage(owner: Owner):
    _still_serves(owner)


# -- KVDirect's messages and descriptors ---------------------------------------------------------

_DESCRIPTORS = st.fixed_dictionaries({
    "name": st.text(max_size=8), "addr": st.integers(-1, 2**64 - 1), "rkey": st.integers(-1, 2**33),
    "dims": st.lists(st.sampled_from(["B", "KV", "L", "H", "D", "X"]), max_size=10),
    "shape": st.lists(st.one_of(st.integers(-1, 8), st.integers(0, 2**62)), max_size=10),
    "stride": st.lists(st.one_of(st.integers(-1, 64), st.integers(0, 2**62)), max_size=10),
    "itemsize": st.integers(-1, 64)})
PACKABLE_INTS = st.integers(-2**63, 2**64 - 1)  # msgpack carries no larger integer
MESSAGES = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda ds: msgpack.packb({"type": "connect", "descriptors": ds}), st.lists(_DESCRIPTORS, max_size=3)),
    st.builds(lambda r: msgpack.packb({"type": "complete", "request_id": r}),
              st.one_of(st.text(max_size=16), PACKABLE_INTS, st.none())),
    st.builds(lambda r, ok: msgpack.packb({"type": "ack", "request_id": r, "released": ok}),
              st.text(max_size=8), st.one_of(st.booleans(), PACKABLE_INTS)),
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(raw=MESSAGES)
@example(raw=msgpack.packb({"type": "connect", "descriptors": [  # 2**40 pieces a block: enumerating them never ends
    {"name": "kv", "addr": 0, "rkey": 1, "dims": ["B", "X", "Y"], "shape": [1, 2**20, 2**20],
     "stride": [1, 2**21, 2], "itemsize": 2}]}))
def test_kvdirect_messages_decode_to_bounded_values_or_are_refused(raw: bytes):
    """A descriptor that decodes has at most MAX_PIECES pieces a block, so enumerating them ends (an
    unbounded one never did: the suite's timeout catches that, the test does not time anything)."""
    try:
        message = _decoder.decode(raw)
    except msgspec.DecodeError:  # ValidationError included: the channel fails the connection on it
        return
    if isinstance(message, Connect):
        for descriptor in message.descriptors:
            assert len(descriptor.piece_offsets()) <= MAX_PIECES
            descriptor.extents(np.arange(min(descriptor.num_blocks, 4)))
