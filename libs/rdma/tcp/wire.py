"""The tcp backend's frames: a fixed 24-byte header, then a segment table and/or payload bytes.

    header = kind u8 | status u8 | reserved u16 | key u32 | wr_id u64 | n u64

READ     key=rkey, n=segments; then n (addr, length) pairs as little-endian int64.
READ_DATA status, wr_id of the READ, n=bytes; then the bytes (none when refused).
WRITE    key=rkey, n=segments; then the (addr, length) table, then the bytes.
WRITE_DONE status, wr_id of the WRITE.
SEND     n=bytes; then the bytes.
BYE      the sender closes the connection (a clean close, not a failure).
HELLO / WELCOME / REFUSE: the handshake; n=bytes of a msgpack body.
"""

from __future__ import annotations

import enum
import os
import socket
import struct

import numpy as np

HEADER = struct.Struct("<BBHIQQ")
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
SOCKET_BUFFER = 4 << 20  # large kernel buffers keep a loopback stream busy between syscalls
# At most this many bytes per send or receive call. Larger calls let one side copy megabytes before
# the other touches them, so the socket's buffers leave the cache between the two copies: a
# pool-to-pool stream measured 3.4 GB/s in 1 MiB calls against 2.3 GB/s in 256 MB calls.
SYSCALL_BYTES = 1 << 20
# What a peer's frame may claim, so that a hostile or broken one is refused before anything is
# allocated for it: segments in one READ or WRITE (a 64 MiB table; a coalesced KV pull of 8,192
# tokens in 16-token blocks over 30 layers, K and V apart, is 30,720), and bytes of SENDs buffered
# before a receive is posted (KVDirect's control messages are at most 64 KiB each).
MAX_SEGMENTS = 1 << 22
MAX_EARLY_BYTES = 1 << 26


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REFUSE = 3
    READ = 10
    READ_DATA = 11
    WRITE = 12
    WRITE_DONE = 13
    SEND = 14
    QUERY = 15  # shm: where is region `key`
    REGION = 16  # shm: the answer
    VIOLATION = 17  # shm: the peer reports an access it refused on our behalf
    BYE = 18  # the peer closes the connection on purpose


class PeerClosed(ConnectionError):
    pass


def header(kind: Kind, *, wr_id: int = 0, n: int = 0, key: int = 0, status: int = 0) -> bytes:
    return HEADER.pack(kind, status, 0, key, wr_id, n)


def segment_table(addrs: np.ndarray, lengths: np.ndarray) -> bytes:
    return np.stack([addrs, lengths], axis=1).astype("<i8", copy=False).tobytes()


def parse_segment_table(raw: bytes | bytearray) -> tuple[np.ndarray, np.ndarray]:
    table = np.frombuffer(raw, dtype="<i8").reshape(-1, 2)
    return table[:, 0], table[:, 1]


def slices(view: memoryview, offsets: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    return [view[o:o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def send_all(sock: socket.socket, buffers: list) -> None:
    """Gather-write every buffer, one window at a time, resuming after partial writes."""
    views = [memoryview(b).cast("B") for b in buffers]
    start = 0
    while start < len(views):
        sent = sock.sendmsg(_window(views, start))
        start = _advance(views, start, sent)


def recv_into_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-read until every view is full, one window at a time; PeerClosed at end of stream."""
    start = 0
    while start < len(views):
        got = sock.recvmsg_into(_window(views, start), 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise PeerClosed("the peer closed the connection")
        start = _advance(views, start, got)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    if n:
        recv_into_all(sock, [memoryview(buf)])
    return buf


def _window(views: list[memoryview], start: int) -> list[memoryview]:
    """views[start:] cut to IOV_MAX buffers and SYSCALL_BYTES bytes: what one syscall moves."""
    window, total = [], 0
    for view in views[start:start + IOV_MAX]:
        if total + view.nbytes >= SYSCALL_BYTES:
            window.append(view[:SYSCALL_BYTES - total])
            break
        window.append(view)
        total += view.nbytes
    return window


def _advance(views: list[memoryview], start: int, done: int) -> int:
    """Drop `done` bytes from the front of views[start:]; returns the first view with bytes left."""
    while done:
        size = views[start].nbytes
        if done < size:
            views[start] = views[start][done:]
            return start
        done -= size
        start += 1
    return start
