"""CaR's prefetcher (III-B.2): when to start loading a waiting request's KV nodes from the cxl tier.

    fetch(t) = 1[ min_i { TPOP * len_i - (t - timer_i) } <= SIZE / bandwidth ]

over the N requests running: the soonest of them is predicted to end (and free the device for the
next request) no later than the load would take, so loading now lands the data just in time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmesh.policies.views import RequestView


def time_to_free_s(running: Sequence[RequestView], now: float, tpop_s: float) -> float:
    """min_i TPOP x len_i - (now - timer_i): len_i the estimated output length, timer_i when request i
    started running (requests not started yet are skipped); +inf when none runs."""
    left = [tpop_s * r.estimated_output_len - (now - r.scheduled_at) for r in running if r.scheduled_at is not None]
    return min(left, default=math.inf)


def fetch(running: Sequence[RequestView], now: float, tpop_s: float, size_bytes: float,
          bandwidth_bytes_per_s: float) -> bool:
    """fetch(t). With nothing running the device is idle and the request is next: load at once
    (the paper's min over an empty set would never fire)."""
    if bandwidth_bytes_per_s <= 0 or size_bytes < 0 or tpop_s < 0:
        raise ValueError(f"fetch needs bandwidth > 0, size >= 0 and TPOP >= 0; got {bandwidth_bytes_per_s}, "
                         f"{size_bytes}, {tpop_s}")
    if not any(r.scheduled_at is not None for r in running):
        return True
    return time_to_free_s(running, now, tpop_s) <= size_bytes / bandwidth_bytes_per_s
