"""How much admission lets in, carried out: the decisions are policies/admission's (a token bucket per
API key, the bounded queue in front of the engines, the wait a new request can expect for its first
token), which the simulator's front door calls too; here they get the service's clock and its tasks.

Each answers "not now" with how long to wait, which the front door turns into 429 and Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvmesh.policies.admission import Admit, AdmissionQueue, Backlog, RateLimiter

__all__ = ["Backlog", "BoundedQueue", "QueueFull", "RateLimiter"]


class QueueFull(Exception):
    """No room in admission's queue."""


class BoundedQueue:
    """AdmissionQueue's decisions for the service's tasks: `slot()` runs at once, waits its turn in
    arrival order, or raises QueueFull at once; each waiting task holds a future the freed slot resolves."""

    def __init__(self, max_running: int, max_queued: int):
        self.max_running = max_running
        self.max_queued = max_queued
        self.decisions: AdmissionQueue[asyncio.Future] = AdmissionQueue(max_running, max_queued)

    @property
    def running(self) -> int:
        return self.decisions.running

    @property
    def waiting(self) -> int:
        return len(self.decisions.waiting)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        turn = asyncio.get_running_loop().create_future()
        admit = self.decisions.arrive(turn)
        if admit is Admit.FULL:
            raise QueueFull(f"admission is full: {self.running} requests running and {self.waiting} queued")
        if admit is Admit.WAIT:
            try:
                await turn
            except BaseException:  # cancelled while queued, or just as its slot came: let the slot go on
                if turn.done() and not turn.cancelled():
                    self._release()
                else:
                    self.decisions.leave(turn)
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        turn = self.decisions.release()
        while turn is not None and turn.cancelled():  # its task was cancelled while queued: the next one's
            turn = self.decisions.release()
        if turn is not None:
            turn.set_result(None)
