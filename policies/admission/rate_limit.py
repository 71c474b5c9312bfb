"""A token bucket per API key: how many requests a tenant may send, answered "not now" with the
seconds until the next is allowed (admission turns that into 429 and Retry-After). Time is an argument."""

from __future__ import annotations

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
