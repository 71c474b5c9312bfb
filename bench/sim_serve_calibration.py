"""bench sim's calibration (issue 31 item 2): before the validated loads, the cluster serves a load
of its own, and the profile is fitted to it: each engine's step cost to the steps it recorded while
serving it (`GET /v1/steps`, each the wall time of its loop's turn: five terms, sim_validation.calibration_fit), and
the request's path outside the engines to the client's timings against the engines' own
(sim.request_path.measure over the admission's per-request `timings_ms`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kvmesh.policies.views import blocks_for
from kvmesh.sim.link import KVGeometry, LinkSpec
from kvmesh.sim.request_path import RequestPath, measure, profile_entry, requests_in_flight
from kvmesh.sim.step_cost import TERMS, StepCost, write_profile

from .loadgen import LoadResult
from .sim_serving import Steps
from .sim_validation import calibration_fit

WORKLOAD = "arxiv"               # the calibration's and the validated loads'
CALIBRATION_SEED = 11            # the calibration load's requests and arrivals (serve's loads: serve.SEED)
SERVED_PROFILES = Path("bench-results")  # sim_profile_<model>_<configuration>_<engine>.json: the run's calibrations


@dataclasses.dataclass
class Calibration:
    """The profile this run fits, before it validates: to the calibration load's steps and path."""

    costs: dict[str, StepCost]   # engine id -> its step cost
    fits: dict[str, dict]        # engine id -> sim.fit's summary of the fit to its steps
    path: RequestPath
    link: LinkSpec
    load: LoadResult
    steps: Steps


def calibrate(load: LoadResult, steps: Steps, geometry: KVGeometry, block_size: int) -> Calibration:
    """The profile fitted to the calibration load, its KV in the model's `geometry` and the run's blocks
    of `block_size` tokens."""
    for engine_id, engine_steps in steps.items():
        if len(engine_steps) < len(TERMS):  # e.g. engines that never answered: nothing to fit
            failed = sum(r.error is not None for r in load.results)
            raise RuntimeError(f"the calibration load left no profile to fit: {engine_id} recorded "
                               f"{len(engine_steps)} steps (a fit needs {len(TERMS)}); {failed} of "
                               f"{len(load.results)} requests failed")
    fitted = {engine_id: calibration_fit(engine_steps) for engine_id, engine_steps in steps.items()}
    return Calibration({e: cost for e, (cost, _) in fitted.items()}, {e: fit for e, (_, fit) in fitted.items()},
                       measured_path(load), measured_link(load, geometry, block_size), load, steps)


def measured_path(load: LoadResult) -> RequestPath:
    """The path outside the engines over a load's completed requests: the client's TTFT and end to
    end against the engines' arrival-to-first-token and their transfer and decode (the admission's
    timings_ms). A split request's decode_queue is the hop through the admission to the decode
    engine and its wait there for blocks and a step; the simulator has no hop, but it runs the wait
    (its decode engine's queue), so only the hop falls to the path: the shortest decode_queue of the
    load, a request that did not wait. (With the whole decode_queue on the path, a calibration near
    capacity put its 1.8 s wait on every request of every load: SmolLM2's 1P1D TPOT at 0.5 req/s
    3.1x the measured, docs/sim.md.) The lag after the first token is fitted against the requests
    in flight at each one's first token."""
    timed = [r for r in load.results if r.ok and r.kvmesh and r.kvmesh.get("timings_ms")]
    engine = [r.kvmesh["timings_ms"] for r in timed]
    hop = min((t.get("decode_queue", 0.0) for t in engine), default=0.0)
    in_flight = requests_in_flight([r.arrival for r in timed], [r.arrival + r.ttft for r in timed],
                                   [r.arrival + r.e2e for r in timed])
    return measure([r.ttft for r in timed], [r.e2e for r in timed],
                   [(t["prefill_queue"] + t["prefill"]) / 1e3 for t in engine],
                   [(t.get("decode_queue", 0.0) - hop + t.get("transfer", 0.0) + t["decode"]) / 1e3 for t in engine],
                   in_flight)


def measured_link(load: LoadResult, geometry: KVGeometry, block_size: int) -> LinkSpec:
    """The link a load's split requests crossed, as sim.link times a pull (latency + bytes /
    bandwidth, the reads' cost sim.link's): the line through each one's transfer (the admission's
    timings_ms) against its prompt's KV bytes (whole blocks of `block_size`, the run's engines', every
    layer of `geometry`). sim.link's loopback defaults where fewer than two requests split (a
    colocated engine); where the line rises slower than their bandwidth allows, that bandwidth and the
    mean latency left. On SmolLM2 the defaults (measured on tiny's 4 layers) said 2.5 ms for arxiv's
    mean prompt, the engines took 8-33 ms."""
    default = LinkSpec()
    pulled = [(blocks_for(r.prompt_tokens, block_size) * geometry.num_layers * geometry.block_bytes(block_size),
               r.kvmesh["timings_ms"]["transfer"] / 1e3)
              for r in load.results if r.ok and r.kvmesh and r.kvmesh.get("timings_ms", {}).get("transfer")]
    if len(pulled) < 2 or np.ptp([b for b, _ in pulled]) == 0:
        return default
    size, seconds = (np.asarray(column, dtype=float) for column in zip(*pulled))
    reads_s = default.per_read_us * 1e-6 * geometry.num_layers
    slope, intercept = np.polyfit(size, seconds - reads_s, 1)
    if slope < 1 / (default.gbps * 1e9):  # faster than loopback's measured bandwidth: the scatter's, not the link's
        slope = 1 / (default.gbps * 1e9)
        intercept = float(np.mean(seconds - reads_s - slope * size))
    return dataclasses.replace(default, gbps=float(1e-9 / slope), latency_us=max(float(intercept), 0.0) * 1e6)


def served_profile_path(model: str, configuration: str, engine_id: str) -> Path:
    return SERVED_PROFILES / f"sim_profile_{model}_{configuration}_{engine_id}.json"


def write_served_profiles(model: str, configuration: str, label: str, calibration: Calibration) -> None:
    """Each engine's calibrated profile in `configuration` (bench serve's `label`) serving `model`, as
    a file sim/ loads (step cost and the request path), for `kvmesh sim run`."""
    load = calibration.load
    path_origin = f"mean over the calibration load's {sum(r.ok for r in load.results)} completed requests of " \
                  f"the client's timings minus the engines' own (timings_ms), kvmesh bench sim"
    for engine_id, cost in calibration.costs.items():
        origin = f"least-squares fit to the {len(calibration.steps[engine_id])} steps {engine_id} recorded " \
                 f"(GET /v1/steps) while serving bench sim's calibration load ({WORKLOAD} at {load.rate:g} req/s, " \
                 f"seed {CALIBRATION_SEED}) in bench serve's {label}"
        write_profile(served_profile_path(model, configuration, engine_id), cost, dict.fromkeys(TERMS, origin),
                      {"model": model, "threads": 1, "source": "engine service (kvmesh bench sim)",
                       "request_path": profile_entry(calibration.path, path_origin)}, calibration.fits[engine_id])
