"""The wait a request arriving now can expect for its first token, and when that refuses it.

Admission counts the requests it holds that have no first token yet, and how fast the cluster has
been giving first tokens lately: by Little's law a request arriving now waits about pending / rate
for those ahead of it. A request that can expect to wait longer than its TTFT SLO (else admission's
`max_wait_s`) is refused (429 queue_full): under overload a long queue would otherwise hold every
request taken for minutes, and the ones after the load for as long. Time is an argument."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator


class Backlog:
    """The requests held without a first token (`pending`) and the first tokens of the last `window_s`.
    Below `min_firsts` first tokens in the window there is no estimate, so a cold or idle cluster
    refuses nothing on it (a burst at once is queued whole)."""

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

    def join(self) -> None:
        """A request is held from now until its first token."""
        self.pending += 1

    def answered(self, now: float) -> None:
        """A held request got its first token at `now` (calls in time order)."""
        self.pending -= 1
        self._firsts.append(now)
        self._since = now if self._since is None else self._since

    def left(self) -> None:
        """A held request ended without a first token."""
        self.pending -= 1

    @contextlib.contextmanager
    def waiting(self) -> Iterator[Callable[[float], None]]:
        """One request's place until its first token, which it marks with the callable it is given
        (the first call counts; a request that ends without one leaves all the same)."""
        self.join()
        marked = False

        def first_token(now: float) -> None:
            nonlocal marked
            if not marked:
                marked = True
                self.answered(now)

        try:
            yield first_token
        finally:
            if not marked:
                self.left()


def behind_by(expected_wait_s: float | None, ttft_slo_ms: float | None, max_wait_s: float | None) -> float | None:
    """How many seconds past its limit (its TTFT SLO, else `max_wait_s`) a request can expect to wait
    for its first token: the Retry-After of its refusal; None when it is let in (no estimate, no limit,
    or within it)."""
    limit = ttft_slo_ms / 1000 if ttft_slo_ms is not None else max_wait_s
    if limit is None or expected_wait_s is None or expected_wait_s <= limit:
        return None
    return expected_wait_s - limit
