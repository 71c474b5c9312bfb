"""Routing policies by name, for config and for the scheduler's `PUT /v1/policy`; other packages add
theirs through the `kvmesh.policies` entry-point group (entry name `routing:NAME`, value a function
with the RoutingPolicy signature)."""

from __future__ import annotations

from importlib.metadata import entry_points

from .least_loaded import least_loaded
from .prefix_aware import prefix_aware
from .round_robin import round_robin
from .views import RoutingPolicy

POLICIES: dict[str, RoutingPolicy] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "prefix_aware": prefix_aware,
}

DEFAULT = "least_loaded"


def names() -> list[str]:
    """Every policy `resolve` finds: the built-in ones, then those of installed packages."""
    plugins = [e.name.partition(":")[2] for e in entry_points(group="kvmesh.policies") if e.name.startswith("routing:")]
    return [*POLICIES, *(n for n in plugins if n not in POLICIES)]


def resolve(name: str) -> RoutingPolicy:
    if name in POLICIES:
        return POLICIES[name]
    for entry in entry_points(group="kvmesh.policies"):
        if entry.name == f"routing:{name}":
            return entry.load()
    raise KeyError(f"no routing policy named {name!r}; known: {', '.join(POLICIES)}")
