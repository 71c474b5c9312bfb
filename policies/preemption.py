"""Preemption: which running requests give up their blocks when the pool runs short, and how.

Victim order: (running, pool) -> request ids, first victim first.
Strategy: (victim, pool) -> "recompute" (drop its KV, recompute it later from its tokens) or
"swap" (move its KV to the cxl tier and back); CacheOpt's sweet spot is in `swap_recompute`.

The orders are CacheOpt's (3.4) and its baselines (2.4). A request's remaining time is its remaining
predicted output tokens (`RequestView.predicted_remaining_tokens`: max_tokens stands in for a missing
prediction) and its KV occupancy is the tokens whose KV it holds (`num_computed`). Ties go to the
latest arrival, as in FCFS.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Literal

from .views import PoolView, RequestView

Strategy = Literal["recompute", "swap"]


# CacheOpt 3.4's magnitude ranges: TBT SLO buckets 0.05-0.2 s, 0.2-0.5 s, 0.5-2 s; token buckets of 128.
TBT_SLO_EDGES_MS = (200.0, 500.0)
TOKEN_BUCKET = 128


def latest_arrival_first(running: Sequence[RequestView], pool: PoolView) -> list[str]:
    """The request that arrived last loses its place first (vLLM's FCFS; registered as `fcfs` too)."""
    return _order(running, lambda r: ())


def srtf(running: Sequence[RequestView], pool: PoolView) -> list[str]:
    """Shortest remaining time first keeps running: the longest remaining time is preempted first."""
    return _order(running, lambda r: (-r.predicted_remaining_tokens,))


def lkvo(running: Sequence[RequestView], pool: PoolView) -> list[str]:
    """Lowest KV occupancy: the request holding the fewest tokens' KV is preempted first, the
    cheapest to swap or recompute."""
    return _order(running, lambda r: (r.num_computed,))


def cacheopt(running: Sequence[RequestView], pool: PoolView) -> list[str]:
    """CacheOpt 3.4: loosest TBT SLO bucket first, then the longest remaining time bucket, then the
    lowest KV occupancy bucket."""
    return _order(running, lambda r: (-tbt_slo_bucket(r.tbt_slo_ms),
                                      -(r.predicted_remaining_tokens // TOKEN_BUCKET),
                                      r.num_computed // TOKEN_BUCKET))


def tbt_slo_bucket(tbt_slo_ms: float | None) -> int:
    """0 for the tightest TBT SLOs, up to len(TBT_SLO_EDGES_MS); no SLO is the loosest bucket."""
    return len(TBT_SLO_EDGES_MS) if tbt_slo_ms is None else bisect_right(TBT_SLO_EDGES_MS, tbt_slo_ms)


def _order(running: Sequence[RequestView], key: Callable[[RequestView], tuple]) -> list[str]:
    """Request ids by `key` ascending, ties to the latest arrival."""
    return [r.request_id for r in sorted(running, key=lambda r: (*key(r), -r.arrival))]


def recompute(victim: RequestView, pool: PoolView) -> Strategy:
    """Always recompute: no copies, but the victim's prefill is done again."""
    return "recompute"


def swap(victim: RequestView, pool: PoolView) -> Strategy:
    """Swap to the cxl tier when it has room for every layer of the victim, else recompute."""
    needed = victim.blocks_per_layer * pool.num_layers
    return "swap" if pool.free.get("cxl", 0) >= needed else "recompute"
