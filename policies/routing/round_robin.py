"""Round robin: each role's engines in turn, by id. The baseline that reads neither load nor cache.

The cursor is the id picked last (per model and role), so an engine that joins takes its turn when
the cursor passes its id, and one that leaves is simply skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from .roles import choose
from .views import EngineView, RouteDecision, RouteQuery, RoutingState


def round_robin(query: RouteQuery, engines: Sequence[EngineView],
                state: RoutingState) -> tuple[RouteDecision | None, RoutingState]:
    cursors = dict(state.cursors)

    def pick(candidates: Sequence[EngineView], role: str) -> EngineView:
        key = f"{query.model}/{role}"
        last = cursors.get(key)
        chosen = next((e for e in candidates if last is None or e.id > last), candidates[0])
        cursors[key] = chosen.id
        return chosen

    decision = choose(query, engines, pick, pick)
    return decision, RoutingState(cursors=cursors)
