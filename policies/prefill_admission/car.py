"""CaR's scheduler (III-B.1): three priority classes by where a request's reusable KV is, and the
Shuffled Window, a fixed-size front of the queue that requests enter and are served from in order.

Classes, by the KV a request would move from the cxl tier to the device:
  0  reuses KV already on the device, and nothing from the cxl tier
  1  has no history at all
  2  reuses anything from the cxl tier: it needs a transfer. The paper ranks it below no history so
     that requests with a transfer pending never hold the device up while one without could run.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.views import PoolView, RequestView


def reuse_class(request: RequestView) -> int:
    if request.cached_cxl_blocks:
        return 2
    return 0 if request.cached_device_blocks else 1


def fill_window(waiting: Sequence[RequestView], size: int, now: float, max_wait_s: float) -> list[str]:
    """The waiting requests that enter the window now, so it holds `size` (members stay until they
    run). Requests that have waited `max_wait_s` go first, oldest first: a strict priority queue
    would let a stream of higher-class arrivals starve a class-2 request, and the window's promise
    (every request runs after an acceptable wait) needs this aging. Then by class and arrival."""
    members = sum(r.window_since is not None for r in waiting)
    outside = [r for r in waiting if r.window_since is None]
    aged = sorted((r for r in outside if now - r.arrival >= max_wait_s), key=lambda r: r.arrival)
    rest = sorted((r for r in outside if now - r.arrival < max_wait_s), key=lambda r: (reuse_class(r), r.arrival))
    return [r.request_id for r in (aged + rest)[:max(0, size - members)]]


def car(waiting: Sequence[RequestView], running: Sequence[RequestView], pool: PoolView, now: float) -> list[str]:
    """The prefill_admission hook: the window's members in the order they entered, then the others
    by class and arrival."""
    members = sorted((r for r in waiting if r.window_since is not None), key=lambda r: (r.window_since, r.arrival))
    others = sorted((r for r in waiting if r.window_since is None), key=lambda r: (reuse_class(r), r.arrival))
    return [r.request_id for r in members + others]
