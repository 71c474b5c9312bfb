"""Least loaded: the engine with the most free device blocks, then the shortest waiting queue, then
the fewest running requests (then the smallest id, so a pick is always reproducible)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from .roles import choose
from .table import EngineTable, load_key
from .views import EngineView, RouteDecision, RouteQuery, RoutingState

__all__ = ["least_loaded", "load_key", "pick_least_loaded"]


def pick_least_loaded(candidates: Sequence[EngineView], role: str) -> EngineView:
    return min(candidates, key=load_key)


def least_loaded(query: RouteQuery, engines: Sequence[EngineView],
                 state: RoutingState) -> tuple[RouteDecision | None, RoutingState]:
    if isinstance(engines, EngineTable) and engines.indexes(query):
        return _from_table(engines), state
    return choose(query, engines, pick_least_loaded, pick_least_loaded), state


def _from_table(table: EngineTable) -> RouteDecision | None:
    """roles.choose's rule with both picks least loaded, each read off the table's heap (one model,
    one KV layout: every prefill engine pairs with every decode engine)."""
    prefill, decode = table.least("prefill"), table.least("decode")
    if prefill is not None and decode is not None:
        return _decision(prefill.id, decode.id, None, prefill.cached_blocks)
    engine = table.least("both")
    if engine is None:  # a pair's surviving side
        engine = min((e for e in (prefill, decode) if e is not None), key=load_key, default=None)
    return None if engine is None else _decision(None, None, engine.id, engine.cached_blocks)


@lru_cache(maxsize=4096)
def _decision(prefill: str | None, decode: str | None, engine: str | None, cached_blocks: int) -> RouteDecision:
    """A decision is frozen: one serves every route that makes it (the table answers for every route
    of a simulated cluster, where building it was a tenth of the route)."""
    return RouteDecision(prefill, decode, engine, cached_blocks)
