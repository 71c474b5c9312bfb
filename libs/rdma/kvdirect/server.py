"""The prefill side of KVDirect: expose the KV tensors, answer CONNECT with their descriptors, and
on each COMPLETE release the request's blocks and ACK. Reads cost this side nothing: they are
served from registered memory by the transport (a NIC, or the tcp backend's responder thread)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

from ..endpoint import Endpoint, QueuePair
from ..work import RdmaError
from .descriptor import TensorDescriptor, describe
from .messages import Ack, Complete, Connect, ControlChannel

log = logging.getLogger(__name__)

ReleaseHook = Callable[[str], bool | Awaitable[bool]]  # request id -> whether its blocks were released


class KVDirectServer:
    def __init__(self, endpoint: Endpoint, on_complete: ReleaseHook, timeout: float = 10.0):
        self.endpoint, self.on_complete, self.timeout = endpoint, on_complete, timeout
        self.descriptors: dict[str, TensorDescriptor] = {}
        self._tasks: set[asyncio.Task] = set()
        self._acceptor: asyncio.Task | None = None

    def expose(self, name: str, tensor, dims: tuple[str, ...] = ("B", "KV", "L", "H", "D")) -> TensorDescriptor:
        """Register `tensor` and describe it to every decode worker that connects from now on."""
        region = self.endpoint.register(tensor)
        self.descriptors[name] = describe(name, tensor, dims, region.addr, region.rkey)
        return self.descriptors[name]

    async def start(self) -> str:
        address = await self.endpoint.start()
        self._acceptor = asyncio.create_task(self._accept_loop())
        return address

    async def close(self) -> None:
        """Ends every connection, whatever is in flight: closing the queue pairs first completes what
        each connection's task waits on (its receives flushed, the peer's writes failed), so the task
        ends by itself. A cancel alone can be lost: Python 3.11's wait_for returns the result of a
        send completing as the cancel arrives, and the task then waits on a receive forever."""
        if self._acceptor is not None:
            self._acceptor.cancel()
        await self.endpoint.close()
        tasks = [t for t in [self._acceptor, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        while True:
            qp = await self.endpoint.accept()
            task = asyncio.create_task(self._serve(qp))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, qp: QueuePair) -> None:
        channel = None
        try:
            channel = ControlChannel(qp, self.timeout)  # posts its receives: fails on a queue pair already cut
            await channel.send(Connect(descriptors=list(self.descriptors.values())))
            while True:
                message = await channel.recv()
                if not isinstance(message, Complete):
                    raise RdmaError(f"unexpected {type(message).__name__} from {qp.peer}")
                await channel.send(await self._release(message.request_id))
        except RdmaError as exc:
            log.info("KVDirect connection from %s ended: %s", qp.peer, exc)
        finally:
            if channel is not None:
                channel.close()
            await qp.close()

    async def _release(self, request_id: str) -> Ack:
        try:
            released = self.on_complete(request_id)
            if inspect.isawaitable(released):
                released = await released
        except Exception as exc:  # the hook's failure is the decode side's answer, not our crash
            log.exception("releasing request %s failed", request_id)
            return Ack(request_id=request_id, released=False, error=str(exc))
        return Ack(request_id=request_id, released=bool(released))
