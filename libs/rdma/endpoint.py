"""The verbs-shaped core every backend implements: an endpoint that registers memory and makes
reliable connected queue pairs, and queue pairs that post READ / WRITE / SEND / RECV.

    endpoint = open_endpoint("tcp", token)        # or "shm", "verbs"
    address = await endpoint.start()              # accepts connections from now on
    region = endpoint.register(kv_pool_tensor)    # peers address it by region.remote()
    qp = await endpoint.connect(peer_address)     # a reliable connection, CONNECT carries the token
    qp.post_read(wr_id, region, segments, rkey)   # one-sided: the peer's application does nothing
    completion = await qp.cq.wait(wr_id)

The owner of a region checks every access: an unknown key or bytes outside the region are refused,
counted in `endpoint.stats.refused_accesses`, and never served; the offending queue pair goes to the
error state (an RC queue pair does), other connections carry on.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import secrets
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .completion import CompletionQueue
from .memory import MemoryRegion, RemoteRegion, locate
from .work import (Completion, LocalAccessError, PeerUnreachable, QueuePairError, RegistrationError, Segments,
                   TransferFailed)

log = logging.getLogger(__name__)


class QpState(enum.Enum):
    RTS = "ready to send"
    ERROR = "error"
    CLOSED = "closed"


@dataclass
class EndpointStats:
    """Counters of what this endpoint's memory served and refused."""

    reads_served: int = 0
    bytes_read: int = 0
    writes_served: int = 0
    bytes_written: int = 0
    refused_accesses: int = 0
    refused_connects: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class QueuePair(ABC):
    """One reliable connection to a peer endpoint. Posts never block; completions go to `cq`."""

    def __init__(self, endpoint: Endpoint, peer: str, cq: CompletionQueue):
        self.endpoint, self.peer, self.cq = endpoint, peer, cq
        self.state = QpState.RTS
        self.error: str | None = None

    def post_read(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        """Read each segment of the peer's region `rkey` into `local`; one completion for the batch."""
        self._check_post(local, segments)
        self._post_read(wr_id, local, segments, rkey)

    def post_write(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        """Write each segment of `local` into the peer's region `rkey`; one completion for the batch."""
        self._check_post(local, segments)
        self._post_write(wr_id, local, segments, rkey)

    def post_send(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None:
        """Send `length` bytes of `local` to the peer's oldest posted receive (two-sided)."""
        self._check_post(local, Segments.one(offset, 0, length))
        self._post_send(wr_id, local, offset, length)

    def post_recv(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None:
        """Offer `length` bytes of `local` to the next message the peer sends."""
        self._check_post(local, Segments.one(offset, 0, length))
        self._post_recv(wr_id, local, offset, length)

    async def read(self, local: MemoryRegion, segments: Segments, rkey: int, timeout: float | None = None) -> Completion:
        """post_read and wait; raises TransferFailed on an error status, and fails the pair on a timeout."""
        wr_id = self.endpoint.next_wr_id()
        self.post_read(wr_id, local, segments, rkey)
        return await self.finish(wr_id, timeout)

    async def write(self, local: MemoryRegion, segments: Segments, rkey: int, timeout: float | None = None) -> Completion:
        wr_id = self.endpoint.next_wr_id()
        self.post_write(wr_id, local, segments, rkey)
        return await self.finish(wr_id, timeout)

    async def finish(self, wr_id: int, timeout: float | None) -> Completion:
        """Wait for `wr_id`'s completion. A peer that does not answer within `timeout` fails the pair."""
        try:
            completion = await self.cq.wait(wr_id, timeout)
        except TimeoutError:
            self.fail(f"no completion from {self.peer} within {timeout} s")
            completion = await self.cq.wait(wr_id, 1.0)
        if not completion.ok:
            raise TransferFailed(completion)
        return completion

    def fail(self, reason: str) -> None:
        """Move to the error state: pending work completes with an error, later posts raise."""
        if self.state is QpState.RTS:
            self.state, self.error = QpState.ERROR, reason
            log.warning("queue pair to %s failed: %s", self.peer, reason)
        self._teardown()

    def closed_by_peer(self) -> None:
        """The peer closed the connection on purpose: outstanding work is flushed, nothing failed."""
        if self.state is QpState.RTS:
            self.state, self.error = QpState.CLOSED, f"{self.peer} closed the connection"
            log.debug("queue pair to %s closed by the peer", self.peer)
        self._teardown()

    async def close(self) -> None:
        self.close_now()

    def close_now(self) -> None:
        """close(), for a caller that cannot await (a handshake thread)."""
        if self.state is not QpState.CLOSED:
            self.state = QpState.CLOSED
            self.error = self.error or "closed"
            self._teardown()
        self.endpoint._forget(self)

    @property
    def usable(self) -> bool:
        return self.state is QpState.RTS

    def _check_post(self, local: MemoryRegion, segments: Segments) -> None:
        if self.state is not QpState.RTS:
            raise QueuePairError(f"queue pair to {self.peer} is {self.state.value}: {self.error}")
        if self.endpoint.regions.get(local.rkey) is not local:
            raise LocalAccessError(f"local region rkey={local.rkey} is not registered with this endpoint")
        segments.check_local(local.length)

    @abstractmethod
    def _post_read(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None: ...

    @abstractmethod
    def _post_write(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None: ...

    @abstractmethod
    def _post_send(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None: ...

    @abstractmethod
    def _post_recv(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None: ...

    @abstractmethod
    def _teardown(self) -> None:
        """Release the transport and complete every outstanding work request with an error."""


class Endpoint(ABC):
    """This process's side of the data plane for one backend: registered memory and connections."""

    backend: str = ""

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0):
        if not token:
            raise ValueError("an endpoint needs the cluster token: CONNECT carries it")
        self.token, self.host, self.port = token, host, port
        self.regions: dict[int, MemoryRegion] = {}
        self.stats = EndpointStats()
        self.queue_pairs: set[QueuePair] = set()
        self._wr_ids = itertools.count(1)
        self._accepted: asyncio.Queue[QueuePair] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._admission = threading.RLock()  # close() against handshakes finishing on other threads

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can run on this machine, else why not."""
        return None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def closing(self) -> bool:
        """close() has begun: a CONNECT is refused from now on."""
        return self._closing

    def next_wr_id(self) -> int:
        return next(self._wr_ids)

    def register(self, buffer: Any) -> MemoryRegion:
        """Register a contiguous buffer (tensor, array, mmap, bytearray); it stays alive while registered."""
        located = locate(buffer)
        rkey = self._new_key()
        region = self._register(MemoryRegion(buffer=located, lkey=rkey, rkey=rkey))
        self.regions[region.rkey] = region
        return region

    def deregister(self, region: MemoryRegion) -> None:
        if self.regions.pop(region.rkey, None) is None:
            raise RegistrationError(f"region rkey={region.rkey} is not registered")
        self._deregister(region)

    def check_access(self, rkey: int, addrs: np.ndarray, lengths: np.ndarray) -> MemoryRegion | str:
        """The region a peer's access falls in, or why it is refused. Used by responders."""
        region = self.regions.get(rkey)
        if region is None:
            return f"unknown remote key {rkey}"
        if (addrs < region.addr).any() or (addrs + lengths > region.addr + region.length).any() or (lengths <= 0).any():
            return f"access outside region rkey={rkey} [{region.addr:#x}, +{region.length})"
        return region

    def refuse_access(self, peer: str, reason: str) -> None:
        self.stats.add(refused_accesses=1)
        log.warning("refused an access from %s: %s", peer, reason)

    def token_ok(self, offered: bytes) -> bool:
        return secrets.compare_digest(offered, self.token.encode())

    async def start(self) -> str:
        """Begin accepting connections; returns the address peers connect to."""
        self._loop = asyncio.get_running_loop()
        self._accepted = asyncio.Queue()
        await self._start()
        return self.address

    async def accept(self, timeout: float | None = None) -> QueuePair:
        """The next queue pair a peer connected to us (for two-sided traffic; one-sided needs none)."""
        if self._accepted is None:
            raise RuntimeError("accept() before start()")
        return await asyncio.wait_for(self._accepted.get(), timeout)

    async def connect(self, address: str, timeout: float = 5.0) -> QueuePair:
        """A reliable connection to the endpoint at `address`; raises ConnectRefused on a bad token."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        try:
            qp = await asyncio.wait_for(self._connect(address, CompletionQueue(self._loop)), timeout)
        except (OSError, TimeoutError) as exc:
            raise PeerUnreachable(f"cannot connect to {address}: {exc or 'timed out'}") from exc
        if not self._admit(qp):
            raise QueuePairError(f"the endpoint closed while connecting to {address}")
        return qp

    async def close(self) -> None:
        with self._admission:
            self._closing = True
        for qp in list(self.queue_pairs):
            await qp.close()
        await self._close()

    def _adopt(self, qp: QueuePair) -> None:
        """A peer's connection was accepted (called on any thread): the queue pair goes to accept()."""
        with self._admission:  # the loop is open while close() has not begun
            if self._admit(qp):
                assert self._loop is not None and self._accepted is not None
                self._loop.call_soon_threadsafe(self._accepted.put_nowait, qp)

    def _admit(self, qp: QueuePair) -> bool:
        """Count `qp` among the queue pairs close() closes; if close() has begun (a handshake finishing
        as the endpoint closes), close `qp` here instead and say so."""
        with self._admission:
            if not self._closing:
                self.queue_pairs.add(qp)
                return True
        qp.close_now()
        return False

    def _forget(self, qp: QueuePair) -> None:
        self.queue_pairs.discard(qp)

    def _new_key(self) -> int:
        while (key := secrets.randbits(32)) in self.regions or key == 0:
            pass
        return key

    def _register(self, region: MemoryRegion) -> MemoryRegion:
        """Backend hook: pin/register the memory; may refuse (RegistrationError)."""
        if region.buffer.view is None:
            raise RegistrationError(f"the {self.backend} backend registers CPU memory only, not {region.buffer.device}")
        return region

    def _deregister(self, region: MemoryRegion) -> None:
        """Backend hook: release what _register took."""

    @abstractmethod
    async def _start(self) -> None: ...

    @abstractmethod
    async def _connect(self, address: str, cq: CompletionQueue) -> QueuePair: ...

    @abstractmethod
    async def _close(self) -> None: ...


def remote_segments(local_offsets, remote: RemoteRegion, remote_offsets, lengths) -> Segments:
    """Segments addressed by offsets into the peer's region (the common case) rather than raw addresses."""
    return Segments(local_offsets, remote.addr + np.asarray(remote_offsets, dtype=np.int64), lengths)
