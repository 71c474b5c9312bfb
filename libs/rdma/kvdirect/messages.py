"""The few two-sided messages of KVDirect, and the channel that carries them over a queue pair.

CONNECT: once a decode worker's connection is up (the transport checked the cluster token), the
prefill worker SENDs the descriptors of the tensors it exposes. COMPLETE: the decode worker tells
the prefill worker a request's blocks are all read; ACK: the prefill worker has released them.
"""

from __future__ import annotations

import asyncio
from collections import deque

import msgspec

from ..endpoint import QueuePair
from ..shm.shared import shared_buffer
from ..work import RdmaError, TransferFailed
from .descriptor import TensorDescriptor


class Connect(msgspec.Struct, tag="connect"):
    descriptors: list[TensorDescriptor]


class Complete(msgspec.Struct, tag="complete"):
    request_id: str


class Ack(msgspec.Struct, tag="ack"):
    request_id: str
    released: bool
    error: str = ""


Message = Connect | Complete | Ack
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ControlChannel:
    """Messages over SEND/RECV on one queue pair: receives pre-posted in slots, sends one at a time."""

    SLOT_BYTES = 64 << 10
    RECV_SLOTS = 4

    def __init__(self, qp: QueuePair, timeout: float):
        self.qp, self.timeout = qp, timeout
        # Shared memory registers with every backend (shm requires it).
        self.region = qp.endpoint.register(shared_buffer((self.RECV_SLOTS + 1) * self.SLOT_BYTES))
        self._posted: deque[tuple[int, int]] = deque()  # (wr_id, slot) in the order messages fill them
        self._send_lock = asyncio.Lock()
        for slot in range(self.RECV_SLOTS):
            self._post_recv(slot)

    async def send(self, message: Message) -> None:
        payload = _encoder.encode(message)
        if len(payload) > self.SLOT_BYTES:
            raise ValueError(f"control message of {len(payload)} bytes exceeds {self.SLOT_BYTES}")
        async with self._send_lock:
            start = self.RECV_SLOTS * self.SLOT_BYTES
            self.region.view[start:start + len(payload)] = payload
            wr_id = self.qp.endpoint.next_wr_id()
            self.qp.post_send(wr_id, self.region, start, len(payload))
            await self.qp.finish(wr_id, self.timeout)

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message; TransferFailed if the connection fails first (or TimeoutError), RdmaError
        (the connection failed too) if the peer's message is malformed."""
        wr_id, slot = self._posted[0]
        completion = await self.qp.cq.wait(wr_id, timeout)
        self._posted.popleft()
        if not completion.ok:
            raise TransferFailed(completion)
        start = slot * self.SLOT_BYTES
        try:
            message = _decoder.decode(self.region.view[start:start + completion.byte_len])
        except msgspec.DecodeError as exc:  # malformed or out of bounds (ValidationError is one too)
            self.qp.fail(f"malformed control message: {exc}")
            raise RdmaError(f"malformed control message from {self.qp.peer}: {exc}") from None
        if self.qp.usable:
            self._post_recv(slot)
        return message

    def close(self) -> None:
        if self.region.rkey in self.qp.endpoint.regions:
            self.qp.endpoint.deregister(self.region)

    def _post_recv(self, slot: int) -> None:
        wr_id = self.qp.endpoint.next_wr_id()
        self.qp.post_recv(wr_id, self.region, slot * self.SLOT_BYTES, self.SLOT_BYTES)
        self._posted.append((wr_id, slot))
