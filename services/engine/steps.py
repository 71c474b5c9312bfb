"""`GET /v1/steps`: the engine's recent steps as its loop saw them, each step's shape (as
policies.step_shape counts it) and the wall time of the loop's whole turn around it, for fitting the
simulator's step cost to the engine in service (`kvmesh sim calibrate --from-engine`)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Annotated

import msgspec
from msgspec import Meta

from kvmesh.policies.step_shape import FIELDS, Shape

CAPACITY = 16384  # steps kept: several minutes of a busy tiny engine, a few hundred kB


class EngineStep(msgspec.Struct, kw_only=True):
    index: int              # the engine's step counter after this step (1 for its first)
    end: float              # unix seconds, the engine's clock, when the turn ended
    seconds: float          # the loop's whole turn: commands taken in, the step, leases, state, frames out
    prefill_tokens: int
    decode_tokens: int
    decode_context: int     # KV tokens the decodes' attention read
    prefill_context: int    # (query, key) pairs the prompt chunks' attention computed
    prefill_sequences: int  # prompts computed from their first token in the step (policies/step_shape.py)
    staged_bytes: int = 0   # LayerKV: KV bytes copied through the step's staging area, loads and write-backs
    pushed_bytes: int = 0   # push mode: KV bytes the step wrote into decode engines' blocks


class EngineSteps(msgspec.Struct, kw_only=True):
    steps: list[EngineStep]   # oldest first, those after `since`
    recorded: int             # steps recorded all time (older ones than the last `capacity` are gone)
    capacity: int | None      # steps kept; None: every step (an in-process bench's log, never the service's)


class StepQuery(msgspec.Struct, kw_only=True, frozen=True):
    since: Annotated[int, Meta(ge=0)] = 0   # only steps whose index is greater


class StepLog:
    """A ring of the latest steps, `capacity` of them (None: all, for a bench that reads its whole run):
    written by the engine's thread, read by the service's."""

    def __init__(self, capacity: int | None = CAPACITY):
        self._steps: deque[EngineStep] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.recorded = 0

    def record(self, index: int, end: float, seconds: float, shape: Shape, staged_bytes: int = 0,
               pushed_bytes: int = 0) -> None:
        step = EngineStep(index=index, end=end, seconds=seconds, **dict(zip(FIELDS, shape)), staged_bytes=staged_bytes,
                          pushed_bytes=pushed_bytes)
        with self._lock:
            self._steps.append(step)
            self.recorded += 1

    def read(self, since: int = 0) -> EngineSteps:
        with self._lock:
            steps = [s for s in self._steps if s.index > since]
            return EngineSteps(steps=steps, recorded=self.recorded, capacity=self._steps.maxlen)
