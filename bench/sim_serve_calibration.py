"""bench sim's calibration (issue 31 item 2): before the validated loads, the cluster serves a load
of its own, and the profile is fitted to it: each engine's step cost to the steps it recorded while
serving it (`GET /v1/steps`, each the wall time of its loop's turn: five terms, sim_validation.calibration_fit), and
the request's path outside the engines to the client's timings against the engines' own
(sim.request_path.measure over the admission's per-request `timings_ms`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from rich.progress import Progress

from kvmesh.sim.request_path import RequestPath, measure, profile_entry, requests_in_flight
from kvmesh.sim.step_cost import TERMS, StepCost, write_profile

from . import serve
from .loadgen import LoadResult, run_load, served_model
from .sim_serving import Steps
from .sim_validation import calibration_fit
from .workloads import WORKLOADS

WORKLOAD = "arxiv"               # the calibration's and the validated loads'
CALIBRATION_RATE = 6             # req/s: between the validated rates, so its steps range from one request to batches
CALIBRATION_SEED = 11            # the calibration load's requests and arrivals (serve's loads: serve.SEED)
SERVED_PROFILES = Path("bench-results")  # sim_profile_<configuration>_<engine>.json: the profiles the run calibrated


@dataclasses.dataclass
class Calibration:
    """The profile this run fits, before it validates: to the calibration load's steps and path."""

    costs: dict[str, StepCost]   # engine id -> its step cost
    fits: dict[str, dict]        # engine id -> sim.fit's summary of the fit to its steps
    path: RequestPath
    load: LoadResult
    steps: Steps


def calibrate(load: LoadResult, steps: Steps) -> Calibration:
    for engine_id, engine_steps in steps.items():
        if len(engine_steps) < len(TERMS):  # e.g. engines that never answered: nothing to fit
            failed = sum(r.error is not None for r in load.results)
            raise RuntimeError(f"the calibration load left no profile to fit: {engine_id} recorded "
                               f"{len(engine_steps)} steps (a fit needs {len(TERMS)}); {failed} of "
                               f"{len(load.results)} requests failed")
    fitted = {engine_id: calibration_fit(engine_steps) for engine_id, engine_steps in steps.items()}
    return Calibration({e: cost for e, (cost, _) in fitted.items()}, {e: fit for e, (_, fit) in fitted.items()},
                       measured_path(load), load, steps)


def measured_path(load: LoadResult) -> RequestPath:
    """The path outside the engines over a load's completed requests: the client's TTFT and end to
    end against the engines' arrival-to-first-token and their transfer and decode (the admission's
    timings_ms). For a split request the hop through the admission to the decode engine, and its
    wait there (decode_queue), fall to the path: the simulator has no hop, and its decode engine's
    wait for a step (part of decode_queue) is counted twice. They grow with the load: the lag after
    the first token is fitted against the requests in flight at each one's first token."""
    timed = [r for r in load.results if r.ok and r.kvmesh and r.kvmesh.get("timings_ms")]
    engine = [r.kvmesh["timings_ms"] for r in timed]
    in_flight = requests_in_flight([r.arrival for r in timed], [r.arrival + r.ttft for r in timed],
                                   [r.arrival + r.e2e for r in timed])
    return measure([r.ttft for r in timed], [r.e2e for r in timed],
                   [(t["prefill_queue"] + t["prefill"]) / 1e3 for t in engine],
                   [(t.get("transfer", 0.0) + t["decode"]) / 1e3 for t in engine], in_flight)


async def calibration_load(url: str, api_key: str, plan: serve.Plan, progress: Progress, label: str,
                           warmed: Callable[[], object]) -> LoadResult:
    """The calibration load: serve's four unmeasured warm-up requests (then `warmed()`), and
    CALIBRATION_RATE's Poisson load of its own requests, as serve.measured_load sends its loads."""
    spec, model = WORKLOADS[WORKLOAD], await served_model(url, api_key)
    await run_load(url, spec.requests(4, CALIBRATION_SEED + 1), 100.0, model=model, api_key=api_key, time_limit_s=60)
    warmed()
    count = max(plan.min_requests, round(CALIBRATION_RATE * plan.window_s))
    return await run_load(url, spec.requests(count, CALIBRATION_SEED), CALIBRATION_RATE, model=model, api_key=api_key,
                          seed=CALIBRATION_SEED, concurrency=serve.CONCURRENCY,
                          time_limit_s=count / CALIBRATION_RATE + plan.drain_s, progress=progress,
                          label=f"{label} · calibration · {WORKLOAD} @ {CALIBRATION_RATE} req/s")


def served_profile_path(configuration: str, engine_id: str) -> Path:
    return SERVED_PROFILES / f"sim_profile_{configuration}_{engine_id}.json"


def write_served_profiles(configuration: str, label: str, calibration: Calibration) -> None:
    """Each engine's calibrated profile in `configuration` (bench serve's `label`) as a file sim/
    loads (step cost and the request path), for `kvmesh sim run`."""
    load = calibration.load
    path_origin = f"mean over the calibration load's {sum(r.ok for r in load.results)} completed requests of " \
                  f"the client's timings minus the engines' own (timings_ms), kvmesh bench sim"
    for engine_id, cost in calibration.costs.items():
        origin = f"least-squares fit to the {len(calibration.steps[engine_id])} steps {engine_id} recorded " \
                 f"(GET /v1/steps) while serving bench sim's calibration load ({WORKLOAD} at {load.rate:g} req/s, " \
                 f"seed {CALIBRATION_SEED}) in bench serve's {label}"
        write_profile(served_profile_path(configuration, engine_id), cost, dict.fromkeys(TERMS, origin),
                      {"model": serve.MODEL, "threads": 1, "source": "engine service (kvmesh bench sim)",
                       "request_path": profile_entry(calibration.path, path_origin)}, calibration.fits[engine_id])
