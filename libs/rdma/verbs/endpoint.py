"""The verbs backend: RDMA NIC (or Soft-RoCE) reliable-connected queue pairs through pyverbs.

    endpoint = open_endpoint("verbs", token, device="mlx5_0", gid_index=3, ib_port=1)

Memory is registered with ibv_reg_mr (LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE), so a region's
lkey/rkey are the NIC's and peers address it by virtual address. A CUDA tensor's device pointer is
registered the same way (GPUDirect RDMA: it needs the nvidia-peermem module, or the amdgpu/habana
peer-memory equivalent; registration fails with that hint otherwise).

CONNECT is a side TCP exchange (see handshake.py) carrying the cluster token and each queue pair's
number, PSN, LID, GID and MTU; the acceptor refuses and counts a wrong token before it makes a
queue pair. One-sided work is served by the NIC, which refuses a bad key or an access outside a
registered region by itself: the requester's completion says REMOTE_ACCESS_ERROR, and this side
learns of it from the device's asynchronous event (IBV_EVENT_QP_ACCESS_ERR), counts it and fails
the queue pair. The NIC serves READs and WRITEs without the CPU, so `reads_served`/`writes_served`
stay 0 here.

Getting pyverbs (not on PyPI in a form that builds without rdma-core's sources): on Debian/Ubuntu
`apt-get install python3-pyverbs`, which matches the system's rdma-core, then use a virtualenv made
with `--system-site-packages` from the system Python (or put /usr/lib/python3/dist-packages on the
path of a venv of the same Python version). PyPI's `pyverbs` builds only where the rdma-core
headers and libraries of the same version are installed. No device: `unavailable_reason()` says why.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from ..completion import CompletionQueue
from ..endpoint import Endpoint, QueuePair
from ..memory import MemoryRegion
from ..work import ConnectRefused, RdmaError, RegistrationError
from .device import Device, enum_names, flags, unavailable_reason
from .handshake import HandshakeError, Hello, Ready, Refuse, Welcome, encode, expect
from .plan import ACCESS_ERROR_EVENT, ACCESS_FLAGS, DEVICE_FATAL_EVENT, QP_ERROR_EVENTS
from .queue_pair import VerbsQueuePair

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
SEND_DEPTH = 512  # work requests in a queue pair's send queue (capped by the device)
RECV_DEPTH = 128


@functools.cache
def _async_event_names() -> dict[int, str]:
    return enum_names((*QP_ERROR_EVENTS, DEVICE_FATAL_EVENT))


class VerbsEndpoint(Endpoint):
    backend = "verbs"

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0, device: str | None = None,
                 gid_index: int = 0, ib_port: int = 1, *, send_depth: int = SEND_DEPTH, recv_depth: int = RECV_DEPTH):
        super().__init__(token, host, port)
        self._device = Device.open(device, ib_port, gid_index)
        self._send_depth = min(send_depth, self._device.max_qp_wr)
        self._recv_depth = min(recv_depth, self._device.max_qp_wr)
        self._mrs: dict[int, Any] = {}  # rkey -> pyverbs MR
        self._server: asyncio.Server | None = None
        self._watching_events = False
        self._closed = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return unavailable_reason()

    # memory

    def _register(self, region: MemoryRegion) -> MemoryRegion:
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError

        where = region.buffer.device
        if where != "cpu" and not where.startswith("cuda"):
            raise RegistrationError(f"the verbs backend registers CPU or CUDA memory, not {where}")
        try:
            mr = MR(self._device.pd, region.length, flags(ACCESS_FLAGS), address=region.addr)
        except PyverbsError as exc:
            hint = " (GPU memory needs GPUDirect RDMA: is nvidia-peermem loaded?)" if where != "cpu" else ""
            raise RegistrationError(f"ibv_reg_mr of {region.length} bytes of {where} memory: {exc}{hint}") from exc
        region.lkey, region.rkey = mr.lkey, mr.rkey
        self._mrs[mr.rkey] = mr
        return region

    def _deregister(self, region: MemoryRegion) -> None:
        self._mrs.pop(region.rkey).close()

    # accepting

    async def _start(self) -> None:
        self._watch_device_events()
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        peer = f"{host}:{port}"
        try:
            await asyncio.wait_for(self._handshake_in(reader, writer, peer), HANDSHAKE_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError, HandshakeError, RdmaError) as exc:
            log.warning("CONNECT from %s failed: %s", peer, exc)
        finally:
            writer.close()

    async def _handshake_in(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        try:
            hello = await expect(reader, Hello)
        except HandshakeError as exc:
            return await self._refuse(writer, peer, f"malformed CONNECT ({exc})")
        reason = self._refusal(hello)
        if reason is not None:
            return await self._refuse(writer, peer, reason)
        assert self._loop is not None
        qp = self._new_queue_pair(peer, CompletionQueue(self._loop))
        try:
            qp.connect_to(hello.qp)
            writer.write(encode(Welcome(qp.info)))
            await writer.drain()
            await expect(reader, Ready)
        except BaseException:
            qp.discard()
            raise
        self._adopt(qp)

    def _refusal(self, hello: Hello) -> str | None:
        if self.closing:
            return "the endpoint is closed"
        if not self.token_ok(hello.token.encode()):
            return "wrong cluster token"
        if hello.backend != self.backend:
            return f"backend mismatch: this endpoint speaks {self.backend}, the peer {hello.backend!r}"
        return None

    async def _refuse(self, writer: asyncio.StreamWriter, peer: str, reason: str) -> None:
        self.stats.add(refused_connects=1)
        log.warning("refused a connection from %s: %s", peer, reason)
        writer.write(encode(Refuse(reason)))
        await writer.drain()

    # connecting

    async def _connect(self, address: str, cq: CompletionQueue) -> QueuePair:
        self._watch_device_events()
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            qp = self._new_queue_pair(address, cq)
            try:
                await self._handshake_out(reader, writer, address, qp)
            except BaseException:
                qp.discard()
                raise
        finally:
            writer.close()
        return qp

    async def _handshake_out(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str,
                             qp: VerbsQueuePair) -> None:
        try:
            writer.write(encode(Hello(token=self.token, backend=self.backend, qp=qp.info)))
            await writer.drain()
            reply = await expect(reader, Welcome, Refuse)
        except (HandshakeError, asyncio.IncompleteReadError) as exc:
            raise ConnectRefused(f"{address} did not answer a kvmesh verbs CONNECT: {exc}") from exc
        if isinstance(reply, Refuse):
            raise ConnectRefused(f"{address} refused the connection: {reply.reason}")
        qp.connect_to(reply.qp)
        writer.write(encode(Ready()))
        await writer.drain()

    def _new_queue_pair(self, peer: str, cq: CompletionQueue) -> VerbsQueuePair:
        return VerbsQueuePair(self, peer, cq, self._device, send_depth=self._send_depth, recv_depth=self._recv_depth)

    # the device's asynchronous events

    def _watch_device_events(self) -> None:
        if not self._watching_events:
            assert self._loop is not None
            self._loop.add_reader(self._device.async_fd, self._on_device_event)
            self._watching_events = True

    def _on_device_event(self) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            event = self._device.context.get_async_event()
        except PyverbsError:  # woken without an event: the fd is non-blocking
            return
        name = _async_event_names().get(event.event_type, f"ibv_event_type {event.event_type}")
        event.ack()
        if name in QP_ERROR_EVENTS:
            self._fail_errored_pairs(name)
        elif name == DEVICE_FATAL_EVENT:
            for qp in list(self.queue_pairs):
                qp.fail(f"{name}: the RDMA device failed")
        else:
            log.info("RDMA device event %s", name)

    def _fail_errored_pairs(self, event: str) -> None:
        # The event names its queue pair by a pointer pyverbs does not expose; the pair it names is
        # the one the NIC has just moved to the error state.
        for qp in list(self.queue_pairs):
            if not (isinstance(qp, VerbsQueuePair) and qp.usable and qp.in_error_state()):
                continue
            if event == ACCESS_ERROR_EVENT:
                self.refuse_access(qp.peer, "the NIC refused a READ or WRITE (unknown key or outside the region)")
            qp.fail(f"{event} on the queue pair to {qp.peer}")

    # closing

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._watching_events and self._loop is not None:
            self._loop.remove_reader(self._device.async_fd)
        for mr in self._mrs.values():
            mr.close()
        self._mrs.clear()
        self._device.close()
