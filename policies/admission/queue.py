"""Admission's bounded queue in front of the engines, as decisions: at most `max_running` requests at
the engines; up to `max_queued` more wait their turn in arrival order; beyond that a request is
refused at once. A slot a request frees goes to the longest-waiting one. The queue holds whatever
stands for a request (the service: a future its handler awaits; the simulator: the request)."""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")


class Admit(Enum):
    RUN = "run"    # a slot was free: it goes to the engines now
    WAIT = "wait"  # queued: `release` hands it a slot in arrival order
    FULL = "full"  # no slot and the queue is full: refused (429 queue_full)


class AdmissionQueue(Generic[T]):
    def __init__(self, max_running: int, max_queued: int):
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"max_running must be >= 1 and max_queued >= 0, got {max_running} and {max_queued}")
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0
        self.waiting: deque[T] = deque()

    def arrive(self, request: T) -> Admit:
        """A request asks for a slot."""
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            return Admit.RUN
        if len(self.waiting) >= self.max_queued:
            return Admit.FULL
        self.waiting.append(request)
        return Admit.WAIT

    def release(self) -> T | None:
        """A running request is done: the waiting request that takes its slot, if any."""
        if self.running < 1:
            raise ValueError("release without a running request")
        if self.waiting:
            return self.waiting.popleft()  # the slot passes on: `running` stays
        self.running -= 1
        return None

    def leave(self, request: T) -> bool:
        """A waiting request gives up (its client went away); False if it was not waiting."""
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        return True
