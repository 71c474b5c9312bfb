"""Preemption: which running requests give up their blocks when the pool runs short, and how.

Victim order: (running, pool) -> request ids, first victim first.
Strategy: (victim, pool) -> "recompute" (drop its KV, recompute it later from its tokens) or
"swap" (move its KV to the cxl tier and back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .views import PoolView, RequestView

Strategy = Literal["recompute", "swap"]


def latest_arrival_first(running: Sequence[RequestView], pool: PoolView) -> list[str]:
    """The request that arrived last loses its place first (vLLM)."""
    return [r.request_id for r in sorted(running, key=lambda r: r.arrival, reverse=True)]


def recompute(victim: RequestView, pool: PoolView) -> Strategy:
    """Always recompute: no copies, but the victim's prefill is done again."""
    return "recompute"


def swap(victim: RequestView, pool: PoolView) -> Strategy:
    """Swap to the cxl tier when it has room for every layer of the victim, else recompute."""
    needed = victim.blocks_per_layer * pool.num_layers
    return "swap" if pool.free.get("cxl", 0) >= needed else "recompute"
