"""Conditional disaggregation: least loaded, except that while the prefill engine it picks is backed
up, a request prefills on its decode engine instead, colocated, if that engine has no queue of its own.

NVIDIA Dynamo's disaggregated router makes the same call (a prefill goes remote only while the
prefill queue is short). It matters where prefill engines are few: a saturated prefill engine's
queue becomes every request's TTFT while the decode engines, bound by reading weights, have compute
to spare. A decode engine that prefills one prompt delays its running decodes by that prompt's
prefill, once; the "routed since the last heartbeat" count the scheduler adds to `waiting` keeps it
to about one such prompt per decode engine a heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence

from .least_loaded import least_loaded
from .table import EngineTable
from .views import EngineView, RouteDecision, RouteQuery, RoutingState

# Requests waiting on the prefill engine (reported, plus routed there since) from which a decode
# engine without a queue prefills the next one itself.
MAX_PREFILL_QUEUE = 2


def conditional(query: RouteQuery, engines: Sequence[EngineView],
                state: RoutingState) -> tuple[RouteDecision | None, RoutingState]:
    decision, state = least_loaded(query, engines, state)
    if decision is None or decision.mode == "colocated":
        return decision, state
    find = engines.get if isinstance(engines, EngineTable) else {e.id: e for e in engines}.__getitem__
    prefill, decode = find(decision.prefill), find(decision.decode)
    if prefill.load.waiting >= MAX_PREFILL_QUEUE and decode.load.waiting == 0:
        return RouteDecision(engine=decode.id, cached_blocks=decode.cached_blocks), state
    return decision, state
