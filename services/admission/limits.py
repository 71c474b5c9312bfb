"""How much admission lets in: a token bucket per API key, a bounded queue in front of the engines, and
the wait a new request can expect for its first token.

Each answers "not now" with how long to wait, which the front door turns into 429 and Retry-After.
Time is an argument of the bucket and of the backlog, so they are tested without a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """`rate` requests per second on average, up to `burst` at once."""

    rate: float
    burst: float
    tokens: float = -1.0
    updated: float = 0.0

    def take(self, now: float) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available."""
        if self.tokens < 0:
            self.tokens, self.updated = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class RateLimiter:
    """One token bucket per API key, all with the same rate and burst; a rate of 0 lets everything in."""

    def __init__(self, requests_per_s: float, burst: float):
        self.requests_per_s = requests_per_s
        self.burst = max(burst, 1.0)
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, key: str, now: float) -> float:
        if self.requests_per_s <= 0:
            return 0.0
        bucket = self._buckets.setdefault(key, TokenBucket(self.requests_per_s, self.burst))
        return bucket.take(now)


class QueueFull(Exception):
    """No room in admission's queue."""


class BoundedQueue:
    """At most `max_running` requests at the engines; up to `max_queued` more wait their turn in
    arrival order; beyond that, `slot()` raises QueueFull at once."""

    def __init__(self, max_running: int, max_queued: int):
        self.max_running = max_running
        self.max_queued = max_queued
        self._running = asyncio.Semaphore(max_running)
        self.waiting = 0
        self.running = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._running.locked() and self.waiting >= self.max_queued:
            raise QueueFull(f"admission is full: {self.running} requests running and {self.waiting} queued")
        self.waiting += 1
        try:
            await self._running.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._running.release()


class Backlog:
    """The requests admission holds that have no first token yet, and how fast the cluster has been
    giving first tokens over the last `window_s`: by Little's law a request arriving now waits about
    pending / rate for those ahead of it. Below `min_firsts` first tokens in the window there is no
    estimate, so a cold or idle cluster refuses nothing on it (a burst at once is queued whole)."""

    def __init__(self, window_s: float = 10.0, min_firsts: int = 4):
        self.window_s = window_s
        self.min_firsts = min_firsts
        self.pending = 0
        self._firsts: deque[float] = deque()
        self._since: float | None = None  # the first first token ever: the window is shorter until it is full

    def expected_wait_s(self, now: float) -> float | None:
        """Seconds a request arriving now can expect to wait for those ahead of it to get their first
        tokens; None without enough first tokens lately to tell."""
        while self._firsts and self._firsts[0] < now - self.window_s:
            self._firsts.popleft()
        if len(self._firsts) < self.min_firsts or self._since is None:
            return None
        span = max(min(self.window_s, now - self._since), 1.0)
        return self.pending / (len(self._firsts) / span)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[Callable[[float], None]]:
        """One request's place until its first token, which it marks with the callable it is given
        (the first call counts; a request that ends without one leaves all the same)."""
        self.pending += 1
        marked = False

        def first_token(now: float) -> None:
            nonlocal marked
            if not marked:
                marked = True
                self.pending -= 1
                self._firsts.append(now)
                self._since = now if self._since is None else self._since

        try:
            yield first_token
        finally:
            if not marked:
                self.pending -= 1
