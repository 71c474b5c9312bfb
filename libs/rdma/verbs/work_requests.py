"""Turning a posted batch into verbs work requests, and the software queue in front of the NIC's.

A READ or WRITE batch becomes one RDMA work request per extent (segments that continue each other
locally and remotely are merged; an extent longer than the port's largest message is split), in
chunks of at most the send queue's depth. Only the last request of a chunk is signalled: the NIC
writes one completion per chunk, and that completion retires every request of the chunk. Every
request of a chunk carries the chunk's id as its wr_id, so an error on an unsignalled request (which
the NIC always reports) still finds its batch. The batch completes, with the caller's wr_id, when
its last chunk does, or at its first failure.

`SendQueue` posts chunks while they fit in the send queue and holds the rest, in order, until
completions make room: posting never blocks and never overruns the queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from ..work import Completion, Opcode, Segments, Status

IBV_OPCODE = {Opcode.READ: "IBV_WR_RDMA_READ", Opcode.WRITE: "IBV_WR_RDMA_WRITE", Opcode.SEND: "IBV_WR_SEND"}


@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One `ibv_send_wr` with a single scatter-gather element (remote fields unused by a SEND)."""

    opcode: str
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int
    signaled: bool


@dataclass(slots=True, eq=False)
class Chunk:
    id: int  # the wr_id of each of its requests
    requests: tuple[WorkRequest, ...]
    batch: Batch


@dataclass(slots=True, eq=False)
class Batch:
    """One post: the caller's wr_id, completed once, when its last chunk completes or one fails."""

    wr_id: int
    opcode: Opcode
    byte_len: int
    chunks: list[Chunk] = field(default_factory=list)
    left: int = 0
    done: bool = False


def extents(segments: Segments, max_message: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local offsets, remote addresses, lengths) of the requests that move `segments`."""
    merged = segments.coalesced()
    local, remote, lengths = merged.local_offsets, merged.remote_addrs, merged.lengths
    pieces = -(-lengths // max_message)
    if (pieces == 1).all():
        return local, remote, lengths
    within = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offsets = within * max_message
    split = np.minimum(np.repeat(lengths, pieces) - offsets, max_message)
    return np.repeat(local, pieces) + offsets, np.repeat(remote, pieces) + offsets, split


def rdma_batch(opcode: Opcode, wr_id: int, local_addr: int, lkey: int, segments: Segments, rkey: int, *,
               depth: int, max_message: int, ids: Iterator[int]) -> Batch:
    """The chained work requests of a READ or WRITE of `segments` between local memory and region `rkey`."""
    local, remote, lengths = extents(segments, max_message)
    requests = [WorkRequest(IBV_OPCODE[opcode], local_addr + lo, length, lkey, ra, rkey, False)
                for lo, ra, length in zip(local.tolist(), remote.tolist(), lengths.tolist())]
    return _batch(opcode, wr_id, segments.total_bytes, requests, depth, ids)


def send_batch(wr_id: int, local_addr: int, lkey: int, length: int, ids: Iterator[int]) -> Batch:
    request = WorkRequest(IBV_OPCODE[Opcode.SEND], local_addr, length, lkey, 0, 0, False)
    return _batch(Opcode.SEND, wr_id, length, [request], 1, ids)


def _batch(opcode: Opcode, wr_id: int, byte_len: int, requests: list[WorkRequest], depth: int,
           ids: Iterator[int]) -> Batch:
    batch = Batch(wr_id, opcode, byte_len)
    for start in range(0, len(requests), depth):
        part = requests[start:start + depth]
        part[-1] = replace(part[-1], signaled=True)
        batch.chunks.append(Chunk(next(ids), tuple(part), batch))
    batch.left = len(batch.chunks)
    return batch


class SendQueue:
    """Chunks in the NIC's send queue (at most `depth` requests) and those waiting for room.

    Thread-safe: push mode submits WRITEs from the engine thread while completions are taken on the
    event loop's, and each call's bookkeeping (what is in flight, how much room is used) is one step.
    """

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError("a send queue holds at least one work request")
        self.depth = depth
        self.in_flight: dict[int, Chunk] = {}
        self.held: deque[Chunk] = deque()
        self.used = 0
        self._lock = threading.Lock()

    def submit(self, batch: Batch) -> list[Chunk]:
        """Queue a batch's chunks; returns those to post now, in order."""
        with self._lock:
            self.held.extend(batch.chunks)
            return self._admit()

    def complete(self, chunk_id: int, status: Status, detail: str = "") -> tuple[Completion | None, list[Chunk]]:
        """A completion for `chunk_id`: the batch's completion if this settles it, and chunks now to post.

        An id no longer in flight (a request flushed after its chunk failed) settles nothing.
        """
        with self._lock:
            chunk = self.in_flight.pop(chunk_id, None)
            if chunk is None:
                return None, []
            self.used -= len(chunk.requests)
            return self._settle(chunk.batch, status, detail), self._admit() if status is Status.SUCCESS else []

    def abort(self, status: Status, detail: str) -> list[Completion]:
        """Empty the queue: the completion of every batch not yet settled, in posting order."""
        with self._lock:
            chunks = [*self.in_flight.values(), *self.held]
            self.in_flight.clear()
            self.held.clear()
            self.used = 0
            settled = (self._settle(chunk.batch, status, detail) for chunk in chunks)
            return [completion for completion in settled if completion is not None]

    def _admit(self) -> list[Chunk]:
        admitted = []
        while self.held and self.used + len(self.held[0].requests) <= self.depth:
            chunk = self.held.popleft()
            self.in_flight[chunk.id] = chunk
            self.used += len(chunk.requests)
            admitted.append(chunk)
        return admitted

    @staticmethod
    def _settle(batch: Batch, status: Status, detail: str) -> Completion | None:
        if batch.done:
            return None
        if status is Status.SUCCESS:
            batch.left -= 1
            if batch.left:
                return None
            batch.done = True
            return Completion(batch.wr_id, batch.opcode, Status.SUCCESS, batch.byte_len)
        batch.done = True
        return Completion(batch.wr_id, batch.opcode, status, 0, detail)
