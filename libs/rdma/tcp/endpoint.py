"""The tcp backend's endpoint: a listener, the CONNECT handshake, and queue pairs over TCP links.

CONNECT is a HELLO carrying the cluster token and the backend's name; the acceptor answers WELCOME
(with whatever the backend adds, see `welcome`) or REFUSE with the reason, and counts refusals.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

import msgpack

from ..completion import CompletionQueue
from ..endpoint import Endpoint, QueuePair
from ..work import ConnectRefused
from .link import shutdown_quietly
from .queue_pair import TcpQueuePair
from .wire import HEADER, Kind, header, recv_exact, tune

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKE_BYTES = 1 << 16


class TcpEndpoint(Endpoint):
    backend = "tcp"
    queue_pair_class: type[TcpQueuePair] = TcpQueuePair

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0):
        super().__init__(token, host, port)
        self._listener: socket.socket | None = None

    async def _start(self) -> None:
        self._listener = socket.create_server((self.host, self.port), backlog=128)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, args=(self._listener,), name=f"{self.backend}-accept",
                         daemon=True).start()

    async def _close(self) -> None:
        if self._listener is not None:
            # Closing alone does not wake a thread blocked in accept() (Linux): it would go on
            # accepting on the still-open socket. A shut-down listener fails the accept.
            shutdown_quietly(self._listener, socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None

    def welcome(self) -> dict[str, Any]:
        """What the acceptor tells a connector beyond yes (the shm backend adds its host identity)."""
        return {}

    def check_welcome(self, welcome: dict[str, Any]) -> None:
        """The connector's check of the acceptor's WELCOME; raise ConnectRefused to back out."""

    # acceptor

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, (host, port) = listener.accept()[:2]
            except OSError:
                return
            threading.Thread(target=self._handshake_in, args=(sock, f"{host}:{port}"), daemon=True).start()

    def _handshake_in(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            hello = _read_message(sock, Kind.HELLO)
            reason = self._refusal(hello)
            if reason is not None:
                self.stats.add(refused_connects=1)
                log.warning("refused a connection from %s: %s", peer, reason)
                _write_message(sock, Kind.REFUSE, {"reason": reason})
                sock.close()
                return
            _write_message(sock, Kind.WELCOME, self.welcome())
            sock.settimeout(None)
        except (OSError, ValueError) as exc:
            log.warning("handshake with %s failed: %s", peer, exc)
            sock.close()
            return
        tune(sock)
        assert self._loop is not None
        self._adopt(self.queue_pair_class(self, peer, CompletionQueue(self._loop), sock))

    def _refusal(self, hello: dict[str, Any]) -> str | None:
        if self.closing:
            return "the endpoint is closed"
        if not isinstance(hello, dict) or not isinstance(hello.get("token"), str):
            return "malformed CONNECT"
        if not self.token_ok(hello["token"].encode()):
            return "wrong cluster token"
        if hello.get("backend") != self.backend:
            return f"backend mismatch: this endpoint speaks {self.backend}, the peer {hello.get('backend')!r}"
        return None

    # connector

    async def _connect(self, address: str, cq: CompletionQueue) -> QueuePair:
        sock = await asyncio.get_running_loop().run_in_executor(None, self._handshake_out, address)
        return self.queue_pair_class(self, address, cq, sock)

    def _handshake_out(self, address: str) -> socket.socket:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=HANDSHAKE_TIMEOUT_S)
        try:
            _write_message(sock, Kind.HELLO, {"token": self.token, "backend": self.backend})
            kind, reply = _read_reply(sock)
            if kind == Kind.REFUSE:
                raise ConnectRefused(f"{address} refused the connection: {reply.get('reason')}")
            self.check_welcome(reply)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        tune(sock)
        return sock


def _write_message(sock: socket.socket, kind: Kind, body: dict[str, Any]) -> None:
    payload = msgpack.packb(body)
    sock.sendall(header(kind, n=len(payload)) + payload)


def _read_reply(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    kind, _, _, _, _, n = HEADER.unpack(recv_exact(sock, HEADER.size))
    if kind not in (Kind.WELCOME, Kind.REFUSE) or n > MAX_HANDSHAKE_BYTES:
        raise ConnectRefused(f"not a kvmesh {kind} handshake reply")
    return kind, msgpack.unpackb(recv_exact(sock, n))


def _read_message(sock: socket.socket, expected: Kind) -> Any:
    kind, _, _, _, _, n = HEADER.unpack(recv_exact(sock, HEADER.size))
    if kind != expected or n > MAX_HANDSHAKE_BYTES:
        raise ValueError(f"expected a {expected.name} frame, got kind {kind} of {n} bytes")
    return msgpack.unpackb(recv_exact(sock, n))
