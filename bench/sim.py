"""`kvmesh bench sim`: the simulator (sim/) against `bench serve`'s configurations, issue 31 item 2.

Two of serve's configurations, each its own `kvmesh up` (the `tiny` preset, one torch thread an
engine): (3) one colocated engine (`colocated`, the simulator's `colocated:1`) and (1) 1P1D pull, a
prefill and a decode engine (`1p1d`, the simulator's `pd:1:1` with sim.link's loopback defaults).
On each, one run calibrates, measures and then simulates:
  0. calibration (bench/sim_serve_calibration.py): the cluster first serves a load of its own
     (`arxiv` at CALIBRATION_RATE, requests and arrivals of CALIBRATION_SEED, none of the validated
     loads'; serve's window), and the profile is fitted to it: each engine's step cost to the steps
     it recorded, and the request's path outside the engines;
  1. measured: the same cluster driven by bench/serve.py's own `measured_load` on `arxiv` at 1, 4, 8
     and 12 req/s (serve's colocated sweep up to 12 req/s, the same in `--quick` and the full run;
     `--quick` has serve's quick windows, 8 s of arrivals, the full run serve's 20 s);
  2. simulated: every request each load sent, with its prompt and output length and its scheduled
     arrival (`RequestResult`), replayed through a `sim.cluster.Cluster` of the same engines with the
     calibrated profile, each engine configured as the real one (bench/sim_serving.py), the tokens
     delivered through the measured path.
Keys, for each configuration c and rate r, each a relative error |simulated - measured| / measured of
the completed requests' figures:
  sim_error_p90_ttft_<c>_<r>, sim_error_mean_tpot_<c>_<r>, sim_error_p90_e2e_<c>_<r>: target <= 0.15
    each (issue 31's validation target names these three);
  sim_error_p50_ttft_<c>_<r>: reported, no target (the issue measures it but sets none).
Information, no target, the same keys with a suffix: the assumptions varied one at a time:
`_in_process`, the in-process profile (PROFILE, Engine.step timed alone) and no path, the simulator
as it was; `_constant_path`, the path's lag after the first token without its growth with the
requests in flight (sim/request_path.py); `_no_path`, the calibrated step costs without the path;
`_with_f`, the step costs fitted to the calibration with the prefill-sequence term f (five terms otherwise);
`_own_steps`, each load's step costs fitted to that load's own steps; `_own_path`, each load's own
measured path; `_own`, both (the best the model's form reaches: a mean cost per step shape, a path
fitted to the load). Also the engine side
(timings_ms against the simulated queue, prefill and decode), each engine's steps over each load
against the simulated ones, and how long each load's real steps took against what the calibrated
cost says of their shapes (`step_time_ratio`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop
from rich.progress import Progress

from kvmesh.sim.cluster import Cluster
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.metrics import summarise
from kvmesh.sim.request import SimRequest
from kvmesh.sim.request_path import RequestPath, delivered
from kvmesh.sim.step_cost import StepCost, load_profile, profile_path
from kvmesh.sim.workload import replay

from . import serve
from .loadgen import STAGES, LoadResult, breakdown, summarize
from .report import BenchResult, Row
from .sim_serve_calibration import (CALIBRATION_RATE, CALIBRATION_SEED, WORKLOAD, Calibration, calibrate,
                                    calibration_load, measured_path, served_profile_path, write_served_profiles)
from .sim_serving import Steps, serving_engines, sim_engines
from .sim_validation import TARGET, TARGETED, calibration_fit, plot, relative_error, six_term_fit, step_time_ratio


@dataclasses.dataclass(frozen=True)
class Configuration:
    key: str            # in its keys: sim_error_<figure>_<key>_<rate>
    setup: serve.Setup  # bench serve's, as it starts it
    topology: str       # the simulator's: its engine ids are kvmesh up's (engine-c0, engine-p0, engine-d0)


CONFIGURATIONS = (Configuration("colocated", serve.COLOCATED, "colocated:1"),
                  Configuration("1p1d", serve.PULL, "pd:1:1"))
RATES = (1, 4, 8, 12)            # serve's arxiv sweep up to 12 req/s, about 3/4 of one engine's capacity
PROFILE = "tiny-cpu-bfloat16-1t"  # the in-process profile (kvmesh sim calibrate), the `_in_process` variation's
FIGURES = {  # key part: (sim.metrics.summarise's key in s, loadgen.summarize's key in ms)
    "p50_ttft": ("ttft_p50_s", "ttft_p50_ms"), "p90_ttft": ("ttft_p90_s", "ttft_p90_ms"),
    "mean_tpot": ("tpot_mean_s", None), "p90_e2e": ("e2e_p90_s", "e2e_p90_ms")}
PLOT = Path("bench-results/sim_validation.png")


def run(quick: bool) -> BenchResult:
    plan = serve.QUICK if quick else serve.FULL
    with (asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, Progress(transient=True) as progress,
          tempfile.TemporaryDirectory(prefix="kvmesh-bench-sim-") as tmp,
          serve.started_together(tuple(c.setup for c in CONFIGURATIONS), Path(tmp), progress) as clusters):
        measured = [measure_configuration(c, clusters[c.setup.key], runner, plan, progress) for c in CONFIGURATIONS]
    in_process = load_profile(PROFILE)
    replayed = []
    for m in measured:
        calibration = calibrate(m.calibration_load, m.calibration_steps)
        write_served_profiles(m.configuration.key, m.configuration.setup.label, calibration)
        replayed.append((m, calibration, variations(calibration, m, in_process)))
    return _result(quick, plan, replayed, in_process)


@dataclasses.dataclass
class Measured:
    """One configuration's run: its engines' state, the calibration load and each validated load,
    with the steps each engine recorded over each."""

    configuration: Configuration
    states: dict[str, dict]       # engine id -> its GET /v1/state before the loads
    calibration_load: LoadResult
    calibration_steps: Steps
    loads: list[LoadResult]
    load_steps: list[Steps]


def measure_configuration(configuration: Configuration, cluster: serve.LocalCluster, runner: asyncio.Runner,
                          plan: serve.Plan, progress: Progress) -> Measured:
    engines = serving_engines(cluster.run_dir)
    states = {engine_id: engine.get("/v1/state") for engine_id, engine in engines.items()}

    def taken() -> Steps:
        return {engine_id: engine.take() for engine_id, engine in engines.items()}

    first = runner.run(calibration_load(cluster.url, cluster.api_key, plan, progress, configuration.setup.label,
                                        warmed=taken))
    calibration_steps, loads, load_steps = taken(), [], []
    for rate in RATES:
        loads.append(runner.run(serve.measured_load(cluster.url, cluster.api_key, WORKLOAD, rate, plan, progress,
                                                    configuration.setup.label)))
        load_steps.append(taken())
    return Measured(configuration, states, first, calibration_steps, loads, load_steps)


# -- the calibration ------------------------------------------------------------------------------


# -- the variations -------------------------------------------------------------------------------


@dataclasses.dataclass
class Variation:
    suffix: str                        # of its keys: sim_error_<figure>_<configuration>_<rate><suffix>
    label: str
    costs: list[dict[str, StepCost]]   # one per load: engine id -> step cost
    paths: list[RequestPath]           # one per load
    summaries: list[dict]              # simulated(), one per load


def variations(calibration: Calibration, measured: Measured, in_process: StepCost) -> list[Variation]:
    """The replay with the calibrated profile, then with one assumption varied at a time: the step
    cost timed in process and no path (the simulator before), a constant path after the first token
    (its growth with the requests in flight left out), no path, the calibration's step costs with
    the prefill-sequence term, and each load's own step
    cost or own path measured on that load instead of the calibration's (how far the calibration
    load's figures carry to other rates), and both: the best the model's form reaches."""
    loads, n, none = measured.loads, len(measured.loads), RequestPath()
    engines = sim_engines(measured.configuration.topology, measured.states)
    own_costs = [{e: calibration_fit(s)[0] for e, s in steps.items()} for steps in measured.load_steps]
    own_paths = [measured_path(load) for load in loads]
    with_f = {e: six_term_fit(s) for e, s in measured.calibration_steps.items()}
    constant = dataclasses.replace(calibration.path, last_token_lag_per_request_s=0.0)
    plans = [("", "simulated", [calibration.costs] * n, [calibration.path] * n),
             ("_constant_path", "constant path", [calibration.costs] * n, [constant] * n),
             ("_in_process", "in-process steps, no path", [dict.fromkeys(calibration.costs, in_process)] * n,
              [none] * n),
             ("_no_path", "no path", [calibration.costs] * n, [none] * n),
             ("_with_f", "calibrated with f", [with_f] * n, [calibration.path] * n),
             ("_own_steps", "each load's own steps", own_costs, [calibration.path] * n),
             ("_own_path", "each load's own path", [calibration.costs] * n, own_paths),
             ("_own", "each load's own steps and path", own_costs, own_paths)]
    return [Variation(suffix, label, costs, paths,
                      [simulated(load, engines, cost, path)
                       for load, cost, path in zip(loads, costs, paths)])
            for suffix, label, costs, paths in plans]


# -- the replay -----------------------------------------------------------------------------------


def sim_requests(load: LoadResult) -> list[SimRequest]:
    """The requests a measured load sent, as it sent them: prompt and output lengths and scheduled
    arrivals. Ids are the load's indices, so a replayed request names the measured one."""
    sent = load.results
    return replay([r.arrival for r in sent], [r.prompt_tokens for r in sent], [r.max_tokens for r in sent],
                  [f"r{r.index}" for r in sent])


def simulated(load: LoadResult, engines: dict[str, tuple[str, EngineSpec, dict[str, str]]],
              costs: dict[str, StepCost], path: RequestPath = RequestPath()) -> dict:
    """The load replayed through a simulated cluster of `engines` (id -> role, spec, policies; the
    link sim.link's defaults, pull mode), each with its cost, the tokens delivered through `path`:
    sim.metrics.summarise's figures, plus each engine's steps and the engine-side breakdown
    (`stages_ms`, before the path)."""
    requests = sim_requests(load)
    members = {e: (role, SimEngine(spec, costs[e], policies)) for e, (role, spec, policies) in engines.items()}
    start = time.perf_counter()
    sim_seconds = Cluster(members).run(requests)
    wall = time.perf_counter() - start
    stages = sim_stages(requests)
    delivered(requests, path)
    return {**summarise(requests, sim_seconds, wall), "steps": {e: engine.steps for e, (_, engine) in members.items()},
            "stages_ms": stages}


def sim_stages(requests: list[SimRequest]) -> dict[str, float]:
    """Mean ms from reaching the engine to first blocks (prefill_queue), to the first token (prefill),
    to the last (decode: a split request's hand-off included), over the finished requests."""
    done = [r for r in requests if r.finished_at is not None]
    if not done:
        return {}
    return {"prefill_queue": float(np.mean([r.scheduled_at - r.arrival for r in done])) * 1e3,
            "prefill": float(np.mean([r.token_times[0] - r.scheduled_at for r in done])) * 1e3,
            "decode": float(np.mean([r.finished_at - r.token_times[0] for r in done])) * 1e3}


def measured_figures(load: LoadResult) -> dict[str, float]:
    """The measured figures in seconds, under FIGURES's names; mean TPOT as loadgen's TBT, averaged."""
    figures = summarize(load)
    out = {name: figures[key] / 1e3 for name, (_, key) in FIGURES.items() if key is not None}
    tbt = [r.tbt for r in load.results if r.ok and r.tbt is not None]
    out["mean_tpot"] = float(np.mean(tbt)) if tbt else math.nan
    return out


def sim_figures(summary: dict) -> dict[str, float]:
    return {name: math.nan if summary[key] is None else summary[key] for name, (key, _) in FIGURES.items()}


# -- the result -----------------------------------------------------------------------------------


Replayed = tuple[Measured, Calibration, list[Variation]]


def _result(quick: bool, plan: serve.Plan, replayed: list[Replayed], in_process: StepCost) -> BenchResult:
    rows, ratios, targets, tables, configs = [], {}, {}, {}, {}
    for measured, calibration, found in replayed:
        c = measured.configuration
        table = {label: {n: [] for n in FIGURES} for label in ["measured", *(v.label for v in found)]}
        stages = {}
        for i, load in enumerate(measured.loads):
            rate, where = f"{load.rate:g}", f"{c.setup.label}, {WORKLOAD} @ {load.rate:g} req/s"
            real = measured_figures(load)
            for label, figures, failed in (("measured", real, summarize(load)["failed"]),
                                           *((v.label, sim_figures(v.summaries[i]), v.summaries[i]["unfinished"])
                                             for v in found)):
                rows.append(Row(compared=label, path=f"{where} ({len(load.results)} requests)",
                                cells={**{f"{n.replace('_', ' ')} ms": figures[n] * 1e3 for n in FIGURES},
                                       "failed": float(failed)}))
                for n in FIGURES:
                    table[label][n].append(figures[n])
            for n in FIGURES:
                key = f"sim_error_{n}_{c.key}_{rate}"
                for v in found:
                    ratios[f"{key}{v.suffix}"] = relative_error(sim_figures(v.summaries[i])[n], real[n])
                if n in TARGETED:
                    targets[key] = TARGET
            stages[rate] = {"measured": {k: v for k, v in (breakdown(load) or {}).items() if k in STAGES},
                            **{v.label: v.summaries[i]["stages_ms"] for v in found}}
            for label in ("measured", found[0].label):
                rows.append(Row(compared=f"{label}, engine side", path=f"{where}, mean per request",
                                cells={f"{k.replace('_', ' ')} ms": v for k, v in stages[rate][label].items()}))
            rows.append(Row(compared="relative error", path=where,
                            cells={f"{n.replace('_', ' ')} ms": ratios[f"sim_error_{n}_{c.key}_{rate}"]
                                   for n in FIGURES}))
        tables[c.setup.label] = table
        configs[c.key] = _configuration_config(measured, calibration, found, stages, in_process)
    plotted = plot([float(r) for r in RATES], "offered requests/s", tables,
                   f"tiny, 1 thread an engine, {WORKLOAD}: measured vs simulated "
                   f"(calibrated in service at {CALIBRATION_RATE} req/s)", PLOT)
    worst = max(targets, key=lambda k: ratios[k] if not math.isnan(ratios[k]) else math.inf)
    met = sum(1 for k in targets if not math.isnan(ratios[k]) and ratios[k] <= TARGET)
    config = {"workload": WORKLOAD, "rates_rps": list(RATES), "window_s": plan.window_s, "drain_s": plan.drain_s,
              "min_requests": plan.min_requests, "seed": serve.SEED, "model": serve.MODEL, "torch_threads": 1,
              "calibration_rate_rps": CALIBRATION_RATE, "calibration_seed": CALIBRATION_SEED,
              "in_process_profile": PROFILE, "in_process_profile_path": str(profile_path(PROFILE)),
              "in_process_step_cost": dataclasses.asdict(in_process), "configurations": configs}
    return BenchResult(
        bench="sim", quick=quick, ratios=ratios, targets=targets, ceilings={},
        directions=dict.fromkeys(targets, "<="), config=config, rows=rows, plots=[plotted],
        headline=f"the simulator, calibrated on the engines in service ({WORKLOAD} at {CALIBRATION_RATE} req/s), "
                 f"against {' and '.join(c.key for c in CONFIGURATIONS)} at {', '.join(map(str, RATES))} req/s: "
                 f"{met} of {len(targets)} errors within {TARGET:.0%}; the largest {worst} = {ratios[worst]:.2f}")


def _configuration_config(measured: Measured, calibration: Calibration, found: list[Variation], stages: dict,
                          in_process: StepCost) -> dict:
    engines = sim_engines(measured.configuration.topology, measured.states)
    plain = found[0].summaries
    return {
        "topology": measured.configuration.topology, "up_args": list(measured.configuration.setup.up_args),
        "calibration": {
            "requests": len(calibration.load.results), "failed": summarize(calibration.load)["failed"],
            "steps": {e: len(s) for e, s in calibration.steps.items()},
            "step_costs": {e: dataclasses.asdict(cost) for e, cost in calibration.costs.items()},
            "fits": calibration.fits, "request_path": dataclasses.asdict(calibration.path),
            "profile_paths": [str(served_profile_path(measured.configuration.key, e)) for e in calibration.costs]},
        "engines": {e: {"role": role, **dataclasses.asdict(spec), "policies": policies}
                    for e, (role, spec, policies) in engines.items()},
        "engines_from": {"device_blocks": "GET /v1/state total_blocks.device",
                         "num_layers": f"the {serve.MODEL} preset",
                         "block_size": "EngineConfig default", "max_num_seqs": "EngineConfig default",
                         "token_budget": "EngineConfig default (0), decided for the engine's role",
                         "policies": "GET /v1/state, the hooks the simulator runs"},
        "variations": {v.suffix or "calibrated": {"label": v.label,
                                                  "step_costs": [{e: dataclasses.asdict(c) for e, c in costs.items()}
                                                                 for costs in v.costs],
                                                  "request_paths": [dataclasses.asdict(p) for p in v.paths]}
                       for v in found},
        "sim_per_wall": [s["sim_per_wall"] for s in plain],
        "preemptions_simulated": [s["preemptions"] for s in plain],
        "preemptions_measured": {e: state.get("preemptions", {}) for e, state in measured.states.items()},
        "engine_side_ms": stages,  # mean per request: the admission's timings_ms (measured) and the simulator's
        "engine_steps": {"measured": [{e: len(s) for e, s in steps.items()} for steps in measured.load_steps],
                         **{v.label: [s["steps"] for s in v.summaries] for v in found},
                         "note": "measured: the steps GET /v1/steps recorded over each load, its 4 warm-up "
                                 "requests included"},
        "step_ms_mean_measured": [{e: float(np.mean([x["seconds"] for x in s])) * 1e3 if s else math.nan
                                   for e, s in steps.items()} for steps in measured.load_steps],
        # how far each load's batches reach past the calibration's: the fit is linear beyond them
        "decode_tokens_per_step": {"calibration": {e: _spread(s) for e, s in calibration.steps.items()},
                                   "loads": [{e: _spread(s) for e, s in steps.items()}
                                             for steps in measured.load_steps]},
        "step_time_ratio": {"calibrated": [{e: step_time_ratio(calibration.costs[e], s) for e, s in steps.items()}
                                           for steps in measured.load_steps],
                            "in_process": [{e: step_time_ratio(in_process, s) for e, s in steps.items()}
                                           for steps in measured.load_steps],
                            "note": "each load's recorded step seconds, summed, over what the cost says of "
                                    "their shapes"},
    }


def _spread(steps: list[dict]) -> dict[str, float]:
    """The decode tokens of the steps that decoded: their mean, 90th percentile and largest."""
    tokens = [s["decode_tokens"] for s in steps if s["decode_tokens"]]
    if not tokens:
        return {}
    return {"mean": float(np.mean(tokens)), "p90": float(np.percentile(tokens, 90)), "max": float(max(tokens))}
