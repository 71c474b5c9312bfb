"""Where a request is in an engine's iteration scheduler (scheduler.py sets it; the engine reads it)."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    WAITING = "waiting"      # queued, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted, KV in the cxl tier
    PULLING = "pulling"      # decode role: blocks given, the prompt's KV on its way from a prefill engine
    FINISHED = "finished"
