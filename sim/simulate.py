"""The one-engine case of the cluster's event loop (sim/cluster.py): requests arrive, the engine steps
whenever it has work, each step lasting what the cost model says; arrivals during a step join the
next one, as in the native engine's loop."""

from __future__ import annotations

from collections.abc import Iterable

from .cluster import Cluster
from .engine import SimEngine
from .request import SimRequest


def simulate(engine: SimEngine, requests: Iterable[SimRequest]) -> float:
    """Run every request through the engine, colocated; the simulated time when the last event
    happened. A request the pool can never hold stays unfinished (its finished_at None)."""
    return Cluster({"engine-c0": ("both", engine)}).run(requests)
