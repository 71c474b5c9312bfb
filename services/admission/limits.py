"""How much admission lets in: a token bucket per API key, and a bounded queue in front of the engines.

Both answer "not now" with how long to wait, which the front door turns into 429 and Retry-After.
Time is an argument of the bucket, so it is tested without a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
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
