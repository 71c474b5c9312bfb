"""The wait a request arriving now can expect for its first token, and when that refuses it.

Admission counts the requests it holds that have no first token yet (`pending`) and how fast the
cluster gives first tokens while it has some to give: the first tokens of the last `window_s` over
the time in it that any request was held (busy). A request arriving now waits about pending / that
rate for those ahead of it. The rate is per busy second, not per second: at light load first tokens
come as fast as requests arrive, not as fast as the cluster could give them, and a request behind one
other would read a wait of a whole gap between arrivals. A request that can expect to wait longer
than its TTFT SLO (else admission's `max_wait_s`) is refused (429 queue_full): under overload a long
queue would otherwise hold every request taken for minutes, and the ones after the load for as long.
Time is an argument."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator


class Backlog:
    """The requests held without a first token (`pending`), the first tokens of the last `window_s`
    and the spans of it in which some request was held. Below `min_firsts` first tokens in the window
    there is no estimate, so a cold or idle cluster refuses nothing on it (a burst at once is queued
    whole)."""

    def __init__(self, window_s: float = 10.0, min_firsts: int = 4):
        self.window_s = window_s
        self.min_firsts = min_firsts
        self.pending = 0
        self._firsts: deque[float] = deque()
        self._busy: deque[tuple[float, float]] = deque()  # the ended spans with a request held
        self._busy_since: float | None = None             # the start of the current one

    def expected_wait_s(self, now: float) -> float | None:
        """Seconds a request arriving now can expect to wait for those ahead of it to get their first
        tokens; None without enough first tokens lately to tell."""
        start = now - self.window_s
        while self._firsts and self._firsts[0] < start:
            self._firsts.popleft()
        while self._busy and self._busy[0][1] <= start:
            self._busy.popleft()
        if len(self._firsts) < self.min_firsts:
            return None
        spans = [*self._busy, *([(self._busy_since, now)] if self._busy_since is not None else [])]
        busy = sum(end - max(begin, start) for begin, end in spans)
        return self.pending * busy / len(self._firsts)

    def join(self, now: float) -> None:
        """A request is held from `now` until its first token."""
        if self.pending == 0:
            self._busy_since = now
        self.pending += 1

    def answered(self, now: float) -> None:
        """A held request got its first token at `now` (calls in time order)."""
        self._firsts.append(now)
        self.left(now)

    def left(self, now: float) -> None:
        """A held request ended at `now`, with its first token or without one."""
        self.pending -= 1
        if self.pending == 0:
            self._busy.append((self._busy_since, now))
            self._busy_since = None

    @contextlib.contextmanager
    def waiting(self, clock: Callable[[], float]) -> Iterator[Callable[[float], None]]:
        """One request's place from now (`clock()`) until its first token, which it marks with the
        callable it is given (the first call counts; a request that ends without one leaves all the
        same, at `clock()` then)."""
        self.join(clock())
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
                self.left(clock())


def behind_by(expected_wait_s: float | None, ttft_slo_ms: float | None, max_wait_s: float | None) -> float | None:
    """How many seconds past its limit (its TTFT SLO, else `max_wait_s`) a request can expect to wait
    for its first token: the Retry-After of its refusal; None when it is let in (no estimate, no limit,
    or within it)."""
    limit = ttft_slo_ms / 1000 if ttft_slo_ms is not None else max_wait_s
    if limit is None or expected_wait_s is None or expected_wait_s <= limit:
        return None
    return expected_wait_s - limit
