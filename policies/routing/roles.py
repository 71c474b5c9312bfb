"""The rule every routing policy shares: a prefill engine and a decode engine, each picked from the
live, not excluded engines of its role that serve the model, of one KV layout (the same backend and
block geometry: KV bytes mean the same on both sides only then); one `both` engine only when the
model has no such pair; and with neither, one engine of the pair that lost its other side (dead, or
restarting), colocated. `both` engines never join a pair."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from .views import EngineView, RouteDecision, RouteQuery

Pick = Callable[[Sequence[EngineView], str], EngineView]  # (candidates of one role, role) -> one of them
ROLES = ("prefill", "decode", "both")
_by_id = attrgetter("id")


def candidates(query: RouteQuery, engines: Sequence[EngineView], role: str) -> list[EngineView]:
    """Engines of `role` that serve the model and are not excluded, by id."""
    return _serving(query, engines).get(role, [])


def _serving(query: RouteQuery, engines: Sequence[EngineView]) -> dict[str, list[EngineView]]:
    """Each role's `candidates`, in one pass over the engines (routing runs per request, over every engine)."""
    model, exclude = query.model, query.exclude
    serving = [e for e in engines if e.model == model and e.id not in exclude]
    serving.sort(key=_by_id)
    roles: dict[str, list[EngineView]] = {role: [] for role in ROLES}
    for e in serving:
        group = roles.get(e.role)
        if group is not None:  # another role is no candidate for any
            group.append(e)
    return roles


def choose(query: RouteQuery, engines: Sequence[EngineView], pick_prefill: Pick,
           pick_decode: Pick) -> RouteDecision | None:
    """A pair when the model has prefill and decode engines, else one colocated engine (picked like a
    prefill engine: it prefills too): a `both` engine, else one of a pair's surviving side; else None."""
    serving = _serving(query, engines)
    decode = serving["decode"]
    layouts = {e.kv_layout for e in decode}
    prefill = [e for e in serving["prefill"] if e.kv_layout in layouts]
    if prefill:
        chosen = pick_prefill(prefill, "prefill")
        partners = [e for e in decode if e.kv_layout == chosen.kv_layout]
        return RouteDecision(prefill=chosen.id, decode=pick_decode(partners, "decode").id,
                             cached_blocks=chosen.cached_blocks)
    both = serving["both"]
    if both:
        engine = pick_prefill(both, "both")
        return RouteDecision(engine=engine.id, cached_blocks=engine.cached_blocks)
    # Every engine can prefill and decode: while a pair's other side is down (its only decode engine
    # restarting, say) the side left serves requests whole, late rather than not at all.
    left = serving["prefill"] + decode
    if left:
        engine = pick_prefill(left, "left")
        return RouteDecision(engine=engine.id, cached_blocks=engine.cached_blocks)
    return None
