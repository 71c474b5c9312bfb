"""`kvmesh sim calibrate --from-engine URL`: the step cost fitted to the steps a running engine
service recorded (`GET /v1/steps`), each the wall time of its loop's turn: the engine as it serves,
not `Engine.step` alone in a process (calibrate.py). Imports no engine: it only reads the API."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from .fit import describe, fit_engine_steps
from .step_cost import TERMS, write_profile


def from_engine(url: str, out: Path, since: int = 0, token: str | None = None) -> int:
    """Fit the step cost to the steps after step `since` that the engine service at `url` recorded,
    and write the profile (step cost only: the request's path outside the engine needs the client's
    timings too, bench/sim.py measures it)."""
    steps = engine_steps(url, since, token)
    cost, fit = fit_engine_steps(steps)
    origin = f"least-squares fit to {len(steps)} steps of the engine service at {url} as its loop timed them " \
             f"(GET /v1/steps, kvmesh sim calibrate --from-engine)"
    write_profile(out, cost, dict.fromkeys(TERMS, origin), {"source": url, "steps_after": since}, fit)
    print(f"{describe(cost, fit, 'steps')}; wrote {out}")
    return 0


def engine_steps(url: str, since: int = 0, token: str | None = None) -> list[dict]:
    """`GET /v1/steps?since=` of the engine service at `url` (its token, default $KVMESH_TOKEN)."""
    token = token or os.environ.get("KVMESH_TOKEN", "")
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/steps?since={since}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["steps"]
