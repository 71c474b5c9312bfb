"""Least loaded: the engine with the most free device blocks, then the shortest waiting queue, then
the fewest running requests (then the smallest id, so a pick is always reproducible)."""

from __future__ import annotations

from collections.abc import Sequence

from .roles import choose
from .views import EngineView, RouteDecision, RouteQuery, RoutingState


def load_key(engine: EngineView) -> tuple[int, int, int, str]:
    """Sort key: least loaded first."""
    load = engine.load
    return -load.free_device_blocks, load.waiting, load.running, engine.id


def pick_least_loaded(candidates: Sequence[EngineView], role: str) -> EngineView:
    return min(candidates, key=load_key)


def least_loaded(query: RouteQuery, engines: Sequence[EngineView],
                 state: RoutingState) -> tuple[RouteDecision | None, RoutingState]:
    return choose(query, engines, pick_least_loaded, pick_least_loaded), state
