"""A queue pair over one TCP link: requester for our posts, responder for the peer's.

The responder serves a READ by handing the writer thread views of the registered memory (sendmsg
gathers them, no copy) and lands a WRITE or a READ's data with recvmsg_into straight into the
region. The peer's application code runs nothing for one-sided work, as with a NIC.
Responses come back in the order of the requests, so outstanding READs and WRITEs are a FIFO.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..completion import CompletionQueue
from ..endpoint import Endpoint, QpState, QueuePair
from ..memory import MemoryRegion
from ..work import Completion, Opcode, Segments, Status
from .link import Link
from .wire import MAX_EARLY_BYTES, MAX_SEGMENTS, Kind, header, parse_segment_table, recv_exact, segment_table, slices


@dataclass(slots=True)
class _Outstanding:
    wr_id: int
    opcode: Opcode
    views: list[memoryview]  # where a READ's bytes land
    nbytes: int


@dataclass(slots=True)
class _PostedRecv:
    wr_id: int
    view: memoryview


class TcpQueuePair(QueuePair):
    def __init__(self, endpoint: Endpoint, peer: str, cq: CompletionQueue, sock):
        super().__init__(endpoint, peer, cq)
        self._lock = threading.Lock()
        self._outstanding: deque[_Outstanding] = deque()
        self._recvs: deque[_PostedRecv] = deque()
        self._early_messages: deque[bytearray] = deque()  # SENDs that came before a RECV was posted
        self._handlers = self._frame_handlers()
        self.link = Link(sock, f"qp-{peer}", self._on_frame, self.fail)
        self.link.start()

    def _frame_handlers(self) -> dict[int, Callable[[int, int, int, int], None]]:
        """What to do with each kind of frame from the peer: (status, key, wr_id, n) -> None."""
        return {Kind.READ: self._serve_read, Kind.READ_DATA: self._land_read,
                Kind.WRITE: self._serve_write, Kind.WRITE_DONE: self._land_write,
                Kind.SEND: self._land_send, Kind.BYE: lambda *_: self.closed_by_peer()}

    # requester side

    def _post_read(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        _check_segments(len(segments))
        views = slices(local.view, segments.local_offsets, segments.lengths)
        self._expect(_Outstanding(wr_id, Opcode.READ, views, segments.total_bytes))
        self.link.send([header(Kind.READ, wr_id=wr_id, n=len(segments), key=rkey),
                        segment_table(segments.remote_addrs, segments.lengths)])

    def _post_write(self, wr_id: int, local: MemoryRegion, segments: Segments, rkey: int) -> None:
        _check_segments(len(segments))
        views = slices(local.view, segments.local_offsets, segments.lengths)
        self._expect(_Outstanding(wr_id, Opcode.WRITE, [], segments.total_bytes))
        self.link.send([header(Kind.WRITE, wr_id=wr_id, n=len(segments), key=rkey),
                        segment_table(segments.remote_addrs, segments.lengths), *views])

    def _post_send(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None:
        done = Completion(wr_id, Opcode.SEND, Status.SUCCESS, length)
        self.link.send([header(Kind.SEND, wr_id=wr_id, n=length), local.view[offset:offset + length]],
                       after=lambda: self.cq.deliver(done))

    def _post_recv(self, wr_id: int, local: MemoryRegion, offset: int, length: int) -> None:
        view = local.view[offset:offset + length]
        with self._lock:
            early = self._early_messages.popleft() if self._early_messages else None
            if early is None:
                self._recvs.append(_PostedRecv(wr_id, view))
                return
        self._fill_recv(_PostedRecv(wr_id, view), len(early), lambda dest: dest.__setitem__(slice(None), early))

    def _expect(self, work: _Outstanding) -> None:
        with self._lock:  # before the request is queued, so its response always finds it
            self._outstanding.append(work)

    # frames from the peer (reader thread)

    def _on_frame(self, kind: int, status: int, key: int, wr_id: int, n: int) -> None:
        handler = self._handlers.get(kind)
        if handler is None:
            raise ValueError(f"unexpected frame kind {kind}")
        handler(status, key, wr_id, n)

    def _serve_read(self, status: int, rkey: int, wr_id: int, n: int) -> None:
        _check_segments(n)
        addrs, lengths = parse_segment_table(recv_exact(self.link.sock, 16 * n))
        region = self.endpoint.check_access(rkey, addrs, lengths)
        if isinstance(region, str):
            return self._refuse(Kind.READ_DATA, wr_id, region)
        total = int(lengths.sum())
        self.link.send([header(Kind.READ_DATA, wr_id=wr_id, n=total),
                        *slices(region.view, addrs - region.addr, lengths)])
        self.endpoint.stats.add(reads_served=n, bytes_read=total)

    def _serve_write(self, status: int, rkey: int, wr_id: int, n: int) -> None:
        _check_segments(n)
        addrs, lengths = parse_segment_table(recv_exact(self.link.sock, 16 * n))
        region = self.endpoint.check_access(rkey, addrs, lengths)
        if isinstance(region, str):
            return self._refuse(Kind.WRITE_DONE, wr_id, region)
        self.link.recv_into(slices(region.view, addrs - region.addr, lengths))
        self.link.send([header(Kind.WRITE_DONE, wr_id=wr_id)])
        self.endpoint.stats.add(writes_served=n, bytes_written=int(lengths.sum()))

    def _refuse(self, reply: Kind, wr_id: int, reason: str) -> None:
        """Answer with an access error and drop the connection, as an RC responder does."""
        self.endpoint.refuse_access(self.peer, reason)
        self.link.send([header(reply, wr_id=wr_id, status=Status.REMOTE_ACCESS_ERROR)],
                       after=lambda: self.fail(f"refused the peer's access: {reason}"))

    def _land_read(self, status: int, key: int, wr_id: int, n: int) -> None:
        work = self._take_outstanding(wr_id)
        if status == Status.SUCCESS:
            if n != work.nbytes:
                raise ValueError(f"READ_DATA of {n} bytes for a READ of {work.nbytes}")
            with self._failed_if_cut(work.wr_id, work.opcode):
                self.link.recv_into(work.views)
        self._complete(work, status)

    def _land_write(self, status: int, key: int, wr_id: int, n: int) -> None:
        self._complete(self._take_outstanding(wr_id), status)

    def _land_send(self, status: int, key: int, wr_id: int, n: int) -> None:
        with self._lock:
            posted = self._recvs.popleft() if self._recvs else None
            buffered = sum(len(m) for m in self._early_messages)
        if posted is None:
            if n + buffered > MAX_EARLY_BYTES:
                raise ValueError(f"a SEND of {n} bytes before any receive was posted: over the {MAX_EARLY_BYTES} "
                                 "bytes buffered for them")
            message = recv_exact(self.link.sock, n)
            with self._lock:  # a receive may have been posted while the message was read
                posted = self._recvs.popleft() if self._recvs else None
                if posted is None:
                    self._early_messages.append(message)
                    return
            self._fill_recv(posted, n, lambda dest: dest.__setitem__(slice(None), message))
            return
        with self._failed_if_cut(posted.wr_id, Opcode.RECV):
            self._fill_recv(posted, n, lambda dest: self.link.recv_into([dest]))

    @contextmanager
    def _failed_if_cut(self, wr_id: int, opcode: Opcode) -> Iterator[None]:
        """While its payload lands, a work request is out of the queue the teardown flushes: if the
        connection drops mid-payload, it completes here with an error (else its waiter would hang
        until its timeout)."""
        try:
            yield
        except BaseException as exc:
            self.cq.deliver(Completion(wr_id, opcode, Status.TRANSPORT_ERROR, 0,
                                       f"the connection to {self.peer} dropped mid-payload: {exc}"))
            raise

    def _fill_recv(self, posted: _PostedRecv, n: int, fill: Callable[[memoryview], None]) -> None:
        if n > posted.view.nbytes:
            reason = f"message of {n} bytes, receive buffer of {posted.view.nbytes}"
            self.cq.deliver(Completion(posted.wr_id, Opcode.RECV, Status.LENGTH_ERROR, n, reason))
            self.fail(reason)  # as an RC queue pair does: both sides end up in the error state
            return
        fill(posted.view[:n])
        self.cq.deliver(Completion(posted.wr_id, Opcode.RECV, Status.SUCCESS, n))

    def _take_outstanding(self, wr_id: int) -> _Outstanding:
        with self._lock:
            work = self._outstanding.popleft() if self._outstanding else None
        if work is None or work.wr_id != wr_id:
            raise ValueError(f"response for wr_id {wr_id} out of order")
        return work

    def _complete(self, work: _Outstanding, status: int) -> None:
        if status == Status.SUCCESS:
            self.cq.deliver(Completion(work.wr_id, work.opcode, Status.SUCCESS, work.nbytes))
            return
        self.cq.deliver(Completion(work.wr_id, work.opcode, Status(status), 0, f"refused by {self.peer}"))
        self.fail(f"the peer refused {work.opcode.name} wr_id={work.wr_id}")

    # teardown

    def _teardown(self) -> None:
        if self.state is QpState.CLOSED:
            self.link.send([header(Kind.BYE)])  # queued before close(), so it goes out first
        self.link.close()
        status = Status.FLUSHED if self.state is QpState.CLOSED else Status.TRANSPORT_ERROR
        with self._lock:
            outstanding, self._outstanding = self._outstanding, deque()
            recvs, self._recvs = self._recvs, deque()
        for work in outstanding:
            self.cq.deliver(Completion(work.wr_id, work.opcode, status, 0, self.error or ""))
        for posted in recvs:
            self.cq.deliver(Completion(posted.wr_id, Opcode.RECV, Status.FLUSHED, 0, self.error or ""))


def _check_segments(n: int) -> None:
    if n > MAX_SEGMENTS:
        raise ValueError(f"{n} segments in one work request: over the {MAX_SEGMENTS} a peer accepts")
