"""Routing policies by name, for config and for the scheduler's `PUT /v1/policy`; other packages add
theirs through the `kvmesh.policies` entry-point group (entry name `routing:NAME`, value a function
with the RoutingPolicy signature)."""

from __future__ import annotations

from .. import plugins
from .conditional import conditional
from .least_loaded import least_loaded
from .prefix_aware import prefix_aware
from .round_robin import round_robin
from .views import RoutingPolicy

POLICIES: dict[str, RoutingPolicy] = {
    "round_robin": round_robin,
    "least_loaded": least_loaded,
    "prefix_aware": prefix_aware,
    "conditional": conditional,
}

DEFAULT = "conditional"


def names() -> list[str]:
    """Every policy `resolve` finds: the built-in ones, then those of installed packages."""
    return plugins.names("routing", POLICIES)


def resolve(name: str) -> RoutingPolicy:
    return plugins.resolve("routing", POLICIES, name, "routing policy")
