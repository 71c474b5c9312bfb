"""CONNECT for the verbs backend: queue-pair details exchanged over a side TCP connection.

    connector -> HELLO(token, backend, its QP)       acceptor checks the token, makes a QP, RTR, RTS
    acceptor  -> WELCOME(its QP) | REFUSE(reason)
    connector -> READY                               its QP is in RTS; the acceptor hands its QP over

Each message is a 4-byte big-endian length and a msgpack body (a tagged msgspec struct). READY keeps
the acceptor's application from sending before the connector's queue pair can receive.
"""

from __future__ import annotations

import asyncio

import msgspec

MAX_MESSAGE_BYTES = 1 << 12


class QpInfo(msgspec.Struct, frozen=True):
    """What a peer needs to address our queue pair."""

    qp_num: int
    psn: int  # our first packet sequence number (24 bits)
    lid: int  # 0 on RoCE
    gid: bytes  # 16 bytes
    mtu: int  # the port's active MTU in bytes
    rd_atomic: int  # READs our responder accepts in flight


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    token: str
    backend: str
    qp: QpInfo


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    qp: QpInfo


class Refuse(msgspec.Struct, frozen=True, tag="refuse"):
    reason: str


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    pass


Message = Hello | Welcome | Refuse | Ready

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class HandshakeError(ValueError):
    """A peer spoke something other than this handshake."""


def encode(message: Message) -> bytes:
    body = _encoder.encode(message)
    return len(body).to_bytes(4, "big") + body


def decode(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise HandshakeError(f"malformed handshake message: {exc}") from exc


async def read_message(reader: asyncio.StreamReader) -> Message:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_MESSAGE_BYTES:
        raise HandshakeError(f"a {size}-byte handshake message (at most {MAX_MESSAGE_BYTES})")
    return decode(await reader.readexactly(size))


async def expect(reader: asyncio.StreamReader, *kinds: type) -> Message:
    message = await read_message(reader)
    if not isinstance(message, kinds):
        raise HandshakeError(f"expected {' or '.join(k.__name__.upper() for k in kinds)}, got "
                             f"{type(message).__name__.upper()}")
    return message
