"""The shm backend: the tcp backend's connection and two-sided messages, with one-sided work done
by the requester itself. Memory in a shared file (the native engine's pools) the requester maps once,
and a READ or WRITE is a copy; private memory (vLLM's KV cache) it reaches by cross-memory attach
(cma.py), the kernel copying between the two processes.

The owner keeps control of its memory: a peer learns where region `rkey` lives only by asking
(QUERY), which the owner refuses (and counts) for an unknown key, and a peer's access outside a
region it was shown is refused locally and reported (VIOLATION) so the owner counts it and drops
the connection, as a NIC would.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from ..memory import MemoryRegion, RemoteRegion
from ..work import Completion, ConnectRefused, Opcode, RegistrationError, Segments, Status
from ..tcp.endpoint import MAX_HANDSHAKE_BYTES, TcpEndpoint
from ..tcp.queue_pair import TcpQueuePair
from ..tcp.wire import Kind, header, recv_exact
from . import cma
from .copy import copy_segments
from .shared import FileSpan, file_span

QUERY_TIMEOUT_S = 5.0
INLINE_BYTES = 8 << 20  # about 1 ms of copying: less than this runs on the posting thread


def host_identity() -> str:
    """Equal for two processes only if they share a kernel (and so /dev/shm)."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + "@" + socket.gethostname()


class RegionInfo(msgspec.Struct, omit_defaults=True):
    """A REGION answer: where region `key` lives, in a shared file (`path`) or in the process `pid`."""

    addr: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    length: Annotated[int, msgspec.Meta(ge=0, lt=2**48)]
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None
    offset: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    pid: Annotated[int, msgspec.Meta(gt=0, lt=2**31)] | None = None
    pid_namespace: Annotated[str, msgspec.Meta(max_length=256)] | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.pid is None):
            raise ValueError("a region is either in a shared file (path) or in a process (pid)")


class ShmQueuePair(TcpQueuePair):
    def __init__(self, endpoint: ShmEndpoint, peer: str, cq, sock):
        # by rkey: the peer's region and its bytes here (a mapping of its file), or its pid (cma)
        self._mapped: dict[int, tuple[RemoteRegion, memoryview | int]] = {}
        self._queries: dict[int, concurrent.futures.Future] = {}
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"shm-{peer}")
        self._posting = threading.Lock()
        self._queued = 0  # work submitted to the copier and not finished
        super().__init__(endpoint, peer, cq, sock)

    def _frame_handlers(self):
        return {**super()._frame_handlers(), Kind.QUERY: self._serve_query, Kind.REGION: self._land_region,
                Kind.VIOLATION: self._reported_violation}

    # one-sided work: a copy, in posting order

    def _post_read(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        self._post_copy(wr_id, Opcode.READ, local, segments, rkey)

    def _post_write(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        self._post_copy(wr_id, Opcode.WRITE, local, segments, rkey)

    def _post_copy(self, wr_id: int, opcode: Opcode, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        # Small work on an already-mapped region runs on the posting thread when nothing is queued
        # ahead of it, as verbs send small payloads inline: the two thread hand-offs of the copier
        # (~0.35 ms here) cost more than copying a few MB. The lock keeps posting order.
        with self._posting:
            if self._queued == 0 and rkey in self._mapped and segments.total_bytes <= INLINE_BYTES:
                self._copy(wr_id, opcode, local, segments, rkey)
                return
            self._queued += 1
        self._copier.submit(self._copy_queued, wr_id, opcode, local, segments, rkey)

    def _copy_queued(self, *work) -> None:
        try:
            self._copy(*work)
        finally:
            with self._posting:
                self._queued -= 1

    def _copy(self, wr_id: int, opcode: Opcode, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        if not self.usable:
            self.cq.deliver(Completion(wr_id, opcode, Status.FLUSHED, 0, self.error or ""))
            return
        try:
            remote, peer_view = self._peer_region(rkey)
        except (OSError, ValueError, TimeoutError, concurrent.futures.CancelledError) as exc:
            self.cq.deliver(Completion(wr_id, opcode, Status.TRANSPORT_ERROR, 0, str(exc)))
            self.fail(f"mapping the peer's region {rkey} failed: {exc}")
            return
        if remote is None:
            self.cq.deliver(Completion(wr_id, opcode, Status.REMOTE_ACCESS_ERROR, 0, f"{self.peer} refused key {rkey}"))
            return  # the owner already dropped the connection
        remote_offsets = segments.remote_addrs - remote.addr
        if (remote_offsets < 0).any() or (remote_offsets + segments.lengths > remote.length).any():
            reason = f"access outside region rkey={rkey} [{remote.addr:#x}, +{remote.length})"
            self.link.send([header(Kind.VIOLATION, key=rkey)])
            self.cq.deliver(Completion(wr_id, opcode, Status.REMOTE_ACCESS_ERROR, 0, reason))
            self.fail(f"refused a local {opcode.name}: {reason}")
            return
        mine = local.view
        if isinstance(peer_view, int):   # the peer's private memory, by its pid
            move = cma.read if opcode is Opcode.READ else cma.write
            try:
                move(peer_view, mine, segments.local_offsets, segments.remote_addrs, segments.lengths)
            except cma.CmaError as exc:
                self.cq.deliver(Completion(wr_id, opcode, Status.TRANSPORT_ERROR, 0, str(exc)))
                self.fail(str(exc))
                return
        elif opcode is Opcode.READ:
            copy_segments(mine, segments.local_offsets, peer_view, remote_offsets, segments.lengths)
        else:
            copy_segments(peer_view, remote_offsets, mine, segments.local_offsets, segments.lengths)
        self.cq.deliver(Completion(wr_id, opcode, Status.SUCCESS, segments.total_bytes))

    def _peer_region(self, rkey: int) -> tuple[RemoteRegion | None, memoryview | int | None]:
        if rkey not in self._mapped:
            future = self._queries[rkey] = concurrent.futures.Future()
            self.link.send([header(Kind.QUERY, key=rkey)])
            info = future.result(QUERY_TIMEOUT_S)
            if info is None:
                return None, None
            region = RemoteRegion(addr=info.addr, length=info.length, rkey=rkey)
            if info.pid is not None:
                if info.pid_namespace != cma.pid_namespace():
                    raise ValueError("the peer's private memory is in another pid namespace")
                self._mapped[rkey] = (region, info.pid)
            else:
                mapping = np.memmap(info.path, dtype=np.uint8, mode="r+", offset=info.offset, shape=(info.length,))
                self._mapped[rkey] = (region, memoryview(mapping))
        return self._mapped[rkey]

    # frames (reader thread)

    def _serve_query(self, status: int, rkey: int, wr_id: int, n: int) -> None:
        span = self.endpoint.spans.get(rkey)
        region = self.endpoint.regions.get(rkey)
        if rkey not in self.endpoint.spans or region is None:
            reason = f"unknown remote key {rkey}"
            self.endpoint.refuse_access(self.peer, reason)
            self.link.send([header(Kind.REGION, key=rkey, status=Status.REMOTE_ACCESS_ERROR)],
                           after=lambda: self.fail(f"refused the peer's access: {reason}"))
            return
        where = ({"path": span.path, "offset": span.offset} if span is not None
                 else {"pid": os.getpid(), "pid_namespace": cma.pid_namespace()})
        body = msgspec.msgpack.encode(RegionInfo(addr=region.addr, length=region.length, **where))
        self.link.send([header(Kind.REGION, key=rkey, n=len(body)), body])

    def _land_region(self, status: int, rkey: int, wr_id: int, n: int) -> None:
        if n > MAX_HANDSHAKE_BYTES:
            raise ValueError(f"a REGION answer of {n} bytes")
        info = None
        if status == Status.SUCCESS:  # a malformed answer is a protocol error: the connection ends
            info = msgspec.msgpack.decode(recv_exact(self.link.sock, n), type=RegionInfo)
        future = self._queries.pop(rkey, None)
        if future is not None:
            future.set_result(info)

    def _reported_violation(self, status: int, rkey: int, wr_id: int, n: int) -> None:
        self.endpoint.refuse_access(self.peer, f"access outside region rkey={rkey}")
        self.fail("the peer accessed outside a region")

    def _teardown(self) -> None:
        super()._teardown()
        for future in list(self._queries.values()):
            future.cancel()
        self._copier.shutdown(wait=False, cancel_futures=False)


class ShmEndpoint(TcpEndpoint):
    backend = "shm"
    queue_pair_class = ShmQueuePair

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0):
        super().__init__(token, host, port)
        self.spans: dict[int, FileSpan | None] = {}   # by rkey: its shared file, None for private memory

    def _register(self, region: MemoryRegion) -> MemoryRegion:
        span = file_span(region.addr, region.length)
        if span is None:
            reason = cma.unavailable_reason()
            if reason is not None:
                raise RegistrationError(
                    f"the buffer at {region.addr:#x} is private memory, which peers read by cross-memory attach, "
                    f"not possible here ({reason}); allocate it in a shared file instead "
                    "(kvmesh.libs.rdma.shm.shared.shared_tensor/shared_buffer, or torch.from_file(path, shared=True))")
            cma.allow_peers()
        region = super()._register(region)
        self.spans[region.rkey] = span
        return region

    def _deregister(self, region: MemoryRegion) -> None:
        self.spans.pop(region.rkey, None)

    def welcome(self) -> dict[str, Any]:
        return {"host": host_identity()}

    def check_welcome(self, welcome: dict[str, Any]) -> None:
        if welcome.get("host") != host_identity():
            raise ConnectRefused("the shm backend connects only to endpoints on this host")

