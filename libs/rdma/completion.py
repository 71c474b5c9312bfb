"""A completion queue that transports fill from any thread and asyncio code drains without spinning."""

from __future__ import annotations

import asyncio

from .work import Completion


class CompletionQueue:
    """Completions in arrival order; `poll` takes what is there, `wait` takes one work request's.

    Backends call `deliver` from their I/O threads; it hops onto the queue's event loop, so waiting
    costs nothing until a completion lands (no busy polling).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self._ready: dict[int, Completion] = {}
        self._waiters: dict[int, asyncio.Future[Completion]] = {}
        self._arrived = asyncio.Event()

    def deliver(self, completion: Completion) -> None:
        """Thread-safe: hand a completion to the queue's loop (ignored once the loop is closed)."""
        try:
            self._loop.call_soon_threadsafe(self._land, completion)
        except RuntimeError:
            pass

    def _land(self, completion: Completion) -> None:
        waiter = self._waiters.pop(completion.wr_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(completion)
            return
        self._ready[completion.wr_id] = completion
        self._arrived.set()

    async def wait(self, wr_id: int, timeout: float | None = None) -> Completion:
        """The completion of `wr_id` (raises TimeoutError after `timeout` seconds)."""
        if wr_id in self._ready:
            return self._ready.pop(wr_id)
        waiter = self._waiters[wr_id] = self._loop.create_future()
        try:
            # asyncio.timeout, not wait_for: wait_for on Python 3.11 can swallow a cancel that comes in
            # the turn the completion lands, and the cancelled caller would wait on (KVDirectServer.close).
            async with asyncio.timeout(timeout):
                return await waiter
        finally:
            self._waiters.pop(wr_id, None)

    async def poll(self, max_entries: int = 64, timeout: float | None = None) -> list[Completion]:
        """At least one completion (or [] after `timeout`), at most `max_entries`, oldest first."""
        if not self._ready:
            self._arrived.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._arrived.wait()
            except TimeoutError:
                return []
        taken = []
        for wr_id in list(self._ready)[:max_entries]:
            taken.append(self._ready.pop(wr_id))
        return taken
