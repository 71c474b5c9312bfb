"""The decode side of KVDirect: connections to prefill workers, each with a transaction queue.

    puller = KVDirectPuller(endpoint)
    puller.expose("device", kv_pool)                       # where pulled blocks land
    report = await puller.pull(prefill_address, "req-1",
                               [BlockReads("device", "device", remote_blocks, local_blocks)])

TRANSFER queues one read per block piece; COMPLETE queues the request's end. The queue is drained
each loop turn: the reads in front of the first COMPLETE are coalesced (both ranges contiguous) and
posted as one batch per tensor pair, without waiting; a COMPLETE waits for its own request's reads,
then SENDs and waits for the prefill side's ACK, one COMPLETE at a time per connection, while reads
of other requests keep flowing. A failed or silent peer fails the requests in flight within the
timeout; the next use of that address connects afresh (workers come and go).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..endpoint import Endpoint, QueuePair
from ..memory import MemoryRegion
from ..work import RdmaError, Segments
from .descriptor import TensorDescriptor, describe
from .messages import Ack, Complete, Connect, ControlChannel

log = logging.getLogger(__name__)


class PeerRefused(RdmaError):
    """The prefill side could not release a completed request's blocks."""


class PeerSilent(RdmaError):
    """The prefill side did not ACK a COMPLETE in time."""


@dataclass(frozen=True)
class BlockReads:
    """Read remote blocks of tensor `remote` into local blocks of tensor `local`, pairwise."""

    remote: str
    local: str
    remote_blocks: np.ndarray | list[int]
    local_blocks: np.ndarray | list[int]


@dataclass
class TransferReport:
    request_id: str
    bytes: int = 0
    pieces: int = 0  # reads asked for (block pieces)
    reads_posted: int = 0  # reads posted after coalescing that carry this request's pieces
    reads_seconds: float = 0.0  # from the first TRANSFER until its last read landed
    seconds: float = 0.0  # until the prefill side ACKed the COMPLETE


@dataclass
class _Read:
    request_id: str
    remote: TensorDescriptor
    local: tuple[MemoryRegion, TensorDescriptor]
    remote_offsets: np.ndarray
    local_offsets: np.ndarray
    size: int


@dataclass
class _Complete:
    request_id: str
    done: asyncio.Future


@dataclass
class _Request:
    report: TransferReport
    started: float = field(default_factory=time.perf_counter)
    batches: list[asyncio.Future] = field(default_factory=list)


def reads_carrying(run_starts: np.ndarray, begin: int, end: int) -> int:
    """How many runs (reads after coalescing; each begins at an index of `run_starts`, the first at 0)
    hold some of the segments begin..end-1."""
    return int(np.searchsorted(run_starts, end) - np.searchsorted(run_starts, begin, "right")) + 1


class PullConnection:
    """One decode-to-prefill connection: CONNECT's descriptors and the transaction queue."""

    def __init__(self, qp: QueuePair, channel: ControlChannel, remote: dict[str, TensorDescriptor],
                 local: dict[str, tuple[MemoryRegion, TensorDescriptor]], coalescing: bool, timeout: float):
        self.qp, self.channel, self.remote, self.local = qp, channel, remote, local
        self.coalescing, self.timeout = coalescing, timeout
        self._queue: deque[_Read | _Complete] = deque()
        self._requests: dict[str, _Request] = {}
        self._complete_lock = asyncio.Lock()
        self._pump_scheduled = False

    @property
    def usable(self) -> bool:
        return self.qp.usable

    def transfer(self, request_id: str, reads: BlockReads) -> None:
        """TRANSFER: queue the reads of `reads` for `request_id` (posted on the next loop turn)."""
        remote, (region, local) = self._tensor_pair(reads)
        remote_blocks, local_blocks = np.asarray(reads.remote_blocks), np.asarray(reads.local_blocks)
        if remote_blocks.shape != local_blocks.shape or remote_blocks.ndim != 1:
            raise ValueError(f"request {request_id}: remote and local block lists differ in length")
        remote_offsets, size = remote.extents(remote_blocks)
        local_offsets, _ = local.extents(local_blocks)
        request = self._requests.setdefault(request_id, _Request(TransferReport(request_id)))
        request.report.pieces += len(remote_offsets)
        request.report.bytes += len(remote_offsets) * size
        self._queue.append(_Read(request_id, remote, (region, local), remote_offsets, local_offsets, size))
        self._schedule_pump()

    async def complete(self, request_id: str) -> TransferReport:
        """COMPLETE: when the request's reads have landed and the prefill side ACKed its release."""
        self._requests.setdefault(request_id, _Request(TransferReport(request_id)))
        done = asyncio.get_running_loop().create_future()
        self._queue.append(_Complete(request_id, done))
        self._schedule_pump()
        return await done

    async def close(self) -> None:
        self.channel.close()
        await self.qp.close()

    def _tensor_pair(self, reads: BlockReads) -> tuple[TensorDescriptor, tuple[MemoryRegion, TensorDescriptor]]:
        if reads.remote not in self.remote:
            raise KeyError(f"the prefill worker {self.qp.peer} exposes no tensor {reads.remote!r} "
                           f"(it has {sorted(self.remote)})")
        if reads.local not in self.local:
            raise KeyError(f"no local tensor {reads.local!r} is exposed (there are {sorted(self.local)})")
        remote, local = self.remote[reads.remote], self.local[reads.local]
        if not remote.same_layout(local[1]):
            raise ValueError(f"tensors {reads.remote!r} (remote) and {reads.local!r} (local) have different block layouts")
        return remote, local

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        try:
            while self._queue:
                reads: list[_Read] = []
                while self._queue and isinstance(self._queue[0], _Read):
                    reads.append(self._queue.popleft())  # type: ignore[arg-type]
                if reads:
                    self._post(reads)
                if self._queue:
                    ending = self._queue.popleft()
                    assert isinstance(ending, _Complete)
                    asyncio.ensure_future(self._finish(ending))
        except RdmaError as exc:  # the queue pair broke before the reads were posted (a cut connection)
            self._fail_queued(exc)

    def _fail_queued(self, exc: RdmaError) -> None:
        """Every request still queued here fails now: its COMPLETE would otherwise wait for a pump that
        never comes, since the next pulls take a new connection (a pull hung this way in the chaos bench)."""
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, _Complete):
                request = self._requests.pop(item.request_id, None)
                for batch in request.batches if request else ():  # reads posted before the break: nobody waits
                    batch.cancel()
                if not item.done.done():
                    item.done.set_exception(exc)

    def _post(self, reads: list[_Read]) -> None:
        groups: dict[tuple[str, str], list[_Read]] = {}
        for read in reads:
            groups.setdefault((read.remote.name, read.local[1].name), []).append(read)
        for group in groups.values():
            remote, (region, _) = group[0].remote, group[0].local
            segments = Segments(np.concatenate([r.local_offsets for r in group]),
                                remote.addr + np.concatenate([r.remote_offsets for r in group]),
                                np.concatenate([np.full(len(r.remote_offsets), r.size, dtype=np.int64) for r in group]))
            starts = segments.run_starts() if self.coalescing else np.arange(len(segments))
            if self.coalescing:
                segments = segments.coalesced()
            wr_id = self.qp.endpoint.next_wr_id()
            self.qp.post_read(wr_id, region, segments, remote.rkey)
            batch = asyncio.ensure_future(self.qp.finish(wr_id, self.timeout))
            end = 0
            for read in group:  # a request's reads: those carrying any of its pieces (a run may span two)
                begin, end = end, end + len(read.remote_offsets)
                request = self._requests[read.request_id]
                if batch not in request.batches:
                    request.batches.append(batch)
                request.report.reads_posted += reads_carrying(starts, begin, end)

    async def _finish(self, ending: _Complete) -> None:
        request = self._requests.pop(ending.request_id)
        try:
            await asyncio.gather(*request.batches)
            request.report.reads_seconds = time.perf_counter() - request.started
            async with self._complete_lock:  # one COMPLETE in flight: the ACK orders them
                await self.channel.send(Complete(request_id=ending.request_id))
                ack = await self._ack()
            if ack.request_id != ending.request_id:
                raise RdmaError(f"ACK for {ack.request_id!r} while completing {ending.request_id!r}")
            if not ack.released:
                raise PeerRefused(f"{self.qp.peer} did not release request {ending.request_id}: {ack.error or 'unknown request'}")
            request.report.seconds = time.perf_counter() - request.started
            ending.done.set_result(request.report)
        except Exception as exc:
            if not isinstance(exc, PeerRefused):
                self.qp.fail(f"completing {ending.request_id} failed: {exc}")
            if not ending.done.done():
                ending.done.set_exception(exc)

    async def _ack(self) -> Ack:
        try:
            message = await self.channel.recv(self.timeout)
        except TimeoutError:
            raise PeerSilent(f"no ACK from {self.qp.peer} within {self.timeout} s") from None
        if not isinstance(message, Ack):
            raise RdmaError(f"expected an ACK from {self.qp.peer}, got {type(message).__name__}")
        return message


class KVDirectPuller:
    def __init__(self, endpoint: Endpoint, coalescing: bool = True, timeout: float = 10.0):
        self.endpoint, self.coalescing, self.timeout = endpoint, coalescing, timeout
        self.local: dict[str, tuple[MemoryRegion, TensorDescriptor]] = {}
        self._connections: dict[str, PullConnection] = {}
        self._connecting: dict[str, asyncio.Task] = {}

    def expose(self, name: str, tensor, dims: tuple[str, ...] = ("B", "KV", "L", "H", "D")) -> TensorDescriptor:
        """Register a local tensor that pulled blocks land in."""
        region = self.endpoint.register(tensor)
        self.local[name] = (region, describe(name, tensor, dims, region.addr, region.rkey))
        return self.local[name][1]

    async def connection(self, address: str) -> PullConnection:
        """The live connection to `address`, CONNECTing when there is none or it failed."""
        current = self._connections.get(address)
        if current is not None and current.usable:
            return current
        if address not in self._connecting:  # concurrent callers share one CONNECT
            self._connecting[address] = asyncio.ensure_future(self._connect(address))
        try:
            return await asyncio.shield(self._connecting[address])
        finally:
            self._connecting.pop(address, None)

    async def pull(self, address: str, request_id: str, reads: list[BlockReads]) -> TransferReport:
        connection = await self.connection(address)
        for item in reads:
            connection.transfer(request_id, item)
        return await connection.complete(request_id)

    async def disconnect(self, address: str) -> None:
        """Drop the connection to a worker that left."""
        connection = self._connections.pop(address, None)
        if connection is not None:
            await connection.close()

    async def close(self) -> None:
        for address in list(self._connections):
            await self.disconnect(address)
        await self.endpoint.close()

    async def _connect(self, address: str) -> PullConnection:
        stale = self._connections.pop(address, None)
        if stale is not None:
            await stale.close()
        qp = await self.endpoint.connect(address, timeout=self.timeout)
        channel = None
        try:
            channel = ControlChannel(qp, self.timeout)  # posts its receives: fails on a queue pair already cut
            hello = await channel.recv(self.timeout)
        except BaseException:
            if channel is not None:
                channel.close()
            await qp.close()
            raise
        if not isinstance(hello, Connect):
            raise RdmaError(f"{address} did not open with CONNECT")
        connection = PullConnection(qp, channel, {d.name: d for d in hello.descriptors}, self.local,
                                    self.coalescing, self.timeout)
        self._connections[address] = connection
        return connection
