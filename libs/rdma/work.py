"""Work requests, completions and errors: the vocabulary every backend speaks.

As in verbs, a READ or WRITE is posted as a batch of work requests (a scatter list of segments) with
one signalled completion for the batch, carrying the caller's `wr_id`. A failed batch completes with
the first failure's status; a remote access error also moves the queue pair to the error state (an
RC queue pair does), so later posts fail and the connection must be rebuilt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class Opcode(enum.IntEnum):
    READ = 0
    WRITE = 1
    SEND = 2
    RECV = 3


class Status(enum.IntEnum):
    SUCCESS = 0
    REMOTE_ACCESS_ERROR = 1  # the peer refused: unknown key or outside its region
    TRANSPORT_ERROR = 2  # the peer went away or stopped answering
    FLUSHED = 3  # posted on a queue pair that then went to the error state
    LENGTH_ERROR = 4  # a message longer than the receive buffer


@dataclass(frozen=True, slots=True)
class Completion:
    wr_id: int
    opcode: Opcode
    status: Status
    byte_len: int = 0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.SUCCESS


class RdmaError(Exception):
    """Base of the data plane's errors."""


class RegistrationError(RdmaError):
    pass


class LocalAccessError(RdmaError):
    """A post names bytes outside the local region: refused before anything is sent."""


class ConnectRefused(RdmaError):
    """The peer answered CONNECT with no (wrong token, other backend, other host)."""


class PeerUnreachable(RdmaError):
    """Nothing answered at the peer's address (it is gone, or not yet up)."""


class QueuePairError(RdmaError):
    """Posting on a queue pair that is in the error state or closed."""


class TransferFailed(RdmaError):
    """Work completed with an error status."""

    def __init__(self, completion: Completion):
        super().__init__(f"{completion.opcode.name} wr_id={completion.wr_id} failed: {completion.status.name}"
                         f"{': ' + completion.detail if completion.detail else ''}")
        self.completion = completion


class Segments:
    """A scatter list: segment i moves `lengths[i]` bytes between local offset and remote address."""

    __slots__ = ("local_offsets", "remote_addrs", "lengths")

    def __init__(self, local_offsets, remote_addrs, lengths):
        self.local_offsets = np.asarray(local_offsets, dtype=np.int64).reshape(-1)
        self.remote_addrs = np.asarray(remote_addrs, dtype=np.int64).reshape(-1)
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if not (len(self.local_offsets) == len(self.remote_addrs) == len(self.lengths)):
            raise ValueError("segments: local_offsets, remote_addrs and lengths differ in length")
        if len(self.lengths) == 0:
            raise ValueError("segments: empty scatter list")
        if (self.lengths <= 0).any() or (self.local_offsets < 0).any() or (self.remote_addrs < 0).any():
            raise ValueError("segments: lengths must be positive, offsets and addresses non-negative")

    @classmethod
    def one(cls, local_offset: int, remote_addr: int, length: int) -> Segments:
        return cls([local_offset], [remote_addr], [length])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    def coalesced(self) -> Segments:
        """Runs of segments where each starts where the previous ended, locally and remotely, merged
        into one (KVDirect section 4.2): the same bytes move, in fewer reads."""
        if len(self) == 1:
            return self
        starts = self.run_starts()
        return Segments(self.local_offsets[starts], self.remote_addrs[starts], np.add.reduceat(self.lengths, starts))

    def run_starts(self) -> np.ndarray:
        """Indices of the segments that begin a run (`coalesced()` makes one segment of each run)."""
        local, remote, lengths = self.local_offsets, self.remote_addrs, self.lengths
        continues = (local[1:] == local[:-1] + lengths[:-1]) & (remote[1:] == remote[:-1] + lengths[:-1])
        return np.flatnonzero(np.r_[True, ~continues])

    def check_local(self, region_length: int) -> None:
        if int((self.local_offsets + self.lengths).max()) > region_length:
            raise LocalAccessError(f"a segment ends past the local region's {region_length} bytes")
