"""One TCP connection driven by two threads: a writer that drains a queue of frames, and a reader
that hands each incoming header to the queue pair. Application threads never block on the socket.

Blocking syscalls release the GIL, so the threads cost nothing while waiting; the writer is the only
one to send, so a large response never interleaves with a request, and the reader is the only one
to receive, so it keeps reading (and the peer keeps sending) while our own responses are queued.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable

from .wire import HEADER, PeerClosed, recv_into_all, send_all

log = logging.getLogger(__name__)

FrameHandler = Callable[[int, int, int, int, int], None]  # kind, status, key, wr_id, n


class Link:
    def __init__(self, sock: socket.socket, name: str, on_frame: FrameHandler, on_lost: Callable[[str], None]):
        self.sock, self.name = sock, name
        self._on_frame, self._on_lost = on_frame, on_lost
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._header = bytearray(HEADER.size)
        self._threads = [threading.Thread(target=self._write_loop, name=f"{name}-tx", daemon=True),
                         threading.Thread(target=self._read_loop, name=f"{name}-rx", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def send(self, buffers: list, after: Callable[[], None] | None = None) -> None:
        """Queue one frame; `after` runs on the writer thread once it is on the wire."""
        self._outbox.put((buffers, after))

    def recv_into(self, views: list[memoryview]) -> None:
        """For the frame handler: the frame's remaining bytes, straight into `views`."""
        recv_into_all(self.sock, views)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(None)  # the writer sends what is queued (e.g. a refusal), then shuts its side
        shutdown_quietly(self.sock, socket.SHUT_RD)  # wakes the reader

    def _write_loop(self) -> None:
        try:
            while (item := self._outbox.get()) is not None:
                buffers, after = item
                send_all(self.sock, buffers)
                if after is not None:
                    after()
            shutdown_quietly(self.sock, socket.SHUT_WR)
        except OSError as exc:
            self._lost(f"sending to the peer failed: {exc}")

    def _read_loop(self) -> None:
        view = memoryview(self._header)
        try:
            while True:
                recv_into_all(self.sock, [view])
                if self._closed.is_set():  # SHUT_RD does not stop the kernel queueing what the peer sends
                    return
                kind, status, _, key, wr_id, n = HEADER.unpack(self._header)
                self._on_frame(kind, status, key, wr_id, n)
        except PeerClosed:
            self._lost("the peer closed the connection")
        except OSError as exc:
            self._lost(f"receiving from the peer failed: {exc}")
        except Exception as exc:  # a protocol error: the connection cannot be trusted any more
            log.exception("%s: frame handling failed", self.name)
            self._lost(f"protocol error: {exc}")
        finally:
            # The reader outlives the writer (close() wakes both), so it alone releases the socket.
            self.close()
            self._threads[0].join(timeout=5)
            self.sock.close()

    def _lost(self, reason: str) -> None:
        if not self._closed.is_set():
            self._on_lost(reason)
        self.close()


def shutdown_quietly(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:  # already disconnected
        pass
