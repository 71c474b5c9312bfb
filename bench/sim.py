"""`kvmesh bench sim [--model NAME]`: the simulator (sim/) against `bench serve`'s configurations,
issue 31 item 2.

Two of serve's configurations, each its own `kvmesh up` (one torch thread an engine): (3) one
colocated engine (`colocated`, the simulator's `colocated:1`) and (1) 1P1D pull, a prefill and a
decode engine (`1p1d`, the simulator's `pd:1:1`, pull mode, the model's KV geometry). The engines'
model (MODELS, each with its rates):
  tiny: serve's preset, at 1, 4, 8 and 12 req/s of `arxiv` (serve's colocated sweep up to 12
     req/s, about 3/4 of one engine's capacity), calibrated at 6; `--quick` has serve's quick
     windows (8 s of arrivals, at least 8 requests a load), the full run serve's (20 s, 16). A
     decode step takes about 1 ms and a TTFT 20-45 ms, so one request's jitter can move a key past
     15%;
  SmolLM2-135M-Instruct (the default, as kvmesh up's; its GGUF's 4-bit layers): at 0.5, 1, 1.5 and 2
     req/s, calibrated at 0.75. Chosen from one measured calibration before the first run (21:34 UTC
     2026-11-28, load 0.3-1.3): arxiv at 0.5 req/s on each configuration took a TTFT of 450 ms (P50)
     and a TBT of 17 ms (colocated) and 10 ms (1P1D); the colocated engine was busy 0.49 s a request
     (prefill 0.7 ms a prompt token and 1.1 us a pair: 0.36 s for arxiv's mean 384-token prompt), the
     1P1D prefill engine 0.40 s; replayed with those fits, the colocated engine's TTFT P50 starts to
     climb at 2 req/s and its TPOT at 1.5 (3.2x the light load's), 1P1D's TPOT at 1.5: light (0.5)
     to just past capacity (2). The calibration runs between the two lightest rates: the first run
     calibrated at 1.25, which under a load average of 8 was past capacity, and its fit (batches
     only) held the constant term at 0. `--quick` has 24 s of arrivals and at least 20 requests a
     load (20, 24, 36 and 48), the full run 60 s and 40. No two loads may send the same number of
     requests: serve's loads draw theirs from one seed, and the engine's prefix cache would answer
     the second load's prompts from the first's (the first run's 0.5 and 1 req/s did: a TTFT of 105 ms).
     Its quick run took 5.1 minutes at a load average of 0.4-2.5, 6.3-7.1 at 7-14, tiny's 2.5. Measured
     on a quiet machine (22:30), 2 req/s is within the colocated engine's capacity (P90 TTFT 955 ms,
     381 at 0.5); at a load average of 7-15 it was past it (17.5 s).
On each, one run calibrates, measures and then simulates:
  0. calibration (bench/sim_serve_calibration.py): the cluster first serves a load of its own
     (`arxiv` at the model's calibration rate, requests and arrivals of CALIBRATION_SEED, none of
     the validated loads'; the same window), and the profile is fitted to it: each engine's step
     cost to the steps it recorded, the request's path outside the engines, and the link (each split
     request's transfer against its KV bytes);
  1. measured: the same cluster driven as bench/serve.py's `measured_load` drives it (its four
     unmeasured warm-up requests, then its requests at the rate) on `arxiv` at the model's rates;
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
`_in_process`, the in-process profile (the model's, tiny only: Engine.step timed alone), no path
and sim.link's loopback defaults, the simulator as it was; `_default_link`, those defaults alone;
`_constant_path`, the path's lag after the first token without its growth with the requests in
flight (sim/request_path.py); `_no_path`, the calibrated step costs without the path;
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

from kvmesh.services.engine.model_source import DEFAULT_MODEL
from kvmesh.sim.cluster import Cluster
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.link import KVGeometry, LinkSpec
from kvmesh.sim.metrics import summarise
from kvmesh.sim.request import SimRequest
from kvmesh.sim.request_path import RequestPath, delivered
from kvmesh.sim.step_cost import StepCost, load_profile, profile_path
from kvmesh.sim.workload import replay

from . import serve
from .loadgen import STAGES, LoadResult, breakdown, summarize
from .report import BenchResult, Row
from .sim_serve_calibration import (CALIBRATION_SEED, WORKLOAD, Calibration, calibrate, measured_path,
                                    served_profile_path, write_served_profiles)
from .sim_serving import Steps, kv_geometry, serving_engines, sim_engines
from .sim_validation import TARGET, TARGETED, calibration_fit, plot, relative_error, six_term_fit, step_time_ratio


@dataclasses.dataclass(frozen=True)
class Configuration:
    key: str            # in its keys: sim_error_<figure>_<key>_<rate>
    setup: serve.Setup  # bench serve's, as it starts it
    topology: str       # the simulator's: its engine ids are kvmesh up's (engine-c0, engine-p0, engine-d0)


CONFIGURATIONS = (Configuration("colocated", serve.COLOCATED, "colocated:1"),
                  Configuration("1p1d", serve.PULL, "pd:1:1"))


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """What the bench runs on one model: the validated rates, the calibration's, the loads' windows."""

    model: str                      # as `kvmesh up --model` names it
    rates: tuple[float, ...]        # req/s, each configuration
    calibration_rate: float         # req/s: between the validated rates
    # the loads' windows: serve.measured_load sends max(min_requests, rate x window_s) requests, of
    # one seed, so each rate's count must differ (else the prefix cache answers a load from another's)
    quick: serve.Plan
    full: serve.Plan
    in_process: str | None = None   # the in-process profile (kvmesh sim calibrate), the `_in_process` variation's

    def configurations(self) -> tuple[Configuration, ...]:
        """CONFIGURATIONS, their engines serving this model."""
        return tuple(dataclasses.replace(c, setup=dataclasses.replace(
            c.setup, env={**c.setup.env, "KVMESH_ENGINE_MODEL": self.model})) for c in CONFIGURATIONS)


TINY = ModelRun("tiny", (1, 4, 8, 12), 6, serve.QUICK, serve.FULL, "tiny-cpu-bfloat16-1t")
SMOLLM2 = ModelRun(DEFAULT_MODEL, (0.5, 1, 1.5, 2), 0.75,
                   serve.Plan(("arxiv",), (), window_s=24, drain_s=90, min_requests=20),
                   serve.Plan(("arxiv",), (), window_s=60, drain_s=120, min_requests=40))
MODELS = {m.model: m for m in (TINY, SMOLLM2)}
FIGURES = {  # key part: (sim.metrics.summarise's key in s, loadgen.summarize's key in ms)
    "p50_ttft": ("ttft_p50_s", "ttft_p50_ms"), "p90_ttft": ("ttft_p90_s", "ttft_p90_ms"),
    "mean_tpot": ("tpot_mean_s", None), "p90_e2e": ("e2e_p90_s", "e2e_p90_ms")}
PLOTS = Path("bench-results")  # sim_validation_<model>.png


def run(quick: bool, model: str = SMOLLM2.model) -> BenchResult:
    if model not in MODELS:
        raise ValueError(f"bench sim has rates for {', '.join(MODELS)}, not {model!r}")
    on = MODELS[model]
    plan = on.quick if quick else on.full
    with (asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, Progress(transient=True) as progress,
          tempfile.TemporaryDirectory(prefix="kvmesh-bench-sim-") as tmp,
          serve.started_together(tuple(c.setup for c in on.configurations()), Path(tmp), progress) as clusters):
        measured = [measure_configuration(c, clusters[c.setup.key], runner, on, plan, progress)
                    for c in on.configurations()]
    in_process = load_profile(on.in_process) if on.in_process else None
    replayed = []
    for m in measured:
        calibration = calibrated(m, model)
        write_served_profiles(model, m.configuration.key, m.configuration.setup.label, calibration)
        replayed.append((m, calibration, variations(calibration, m, model, in_process)))
    return _result(quick, on, plan, replayed, in_process)


@dataclasses.dataclass
class Measured:
    """One configuration's run: its engines' state, the calibration load and each validated load,
    with the steps each engine recorded over each (its warm-up's left out)."""

    configuration: Configuration
    states: dict[str, dict]       # engine id -> its GET /v1/state before the loads
    calibration_load: LoadResult
    calibration_steps: Steps
    loads: list[LoadResult]
    load_steps: list[Steps]


def measure_configuration(configuration: Configuration, cluster: serve.LocalCluster, runner: asyncio.Runner,
                          on: ModelRun, plan: serve.Plan, progress: Progress) -> Measured:
    engines = serving_engines(cluster.run_dir)
    states = {engine_id: engine.get("/v1/state") for engine_id, engine in engines.items()}

    def taken() -> Steps:
        return {engine_id: engine.take() for engine_id, engine in engines.items()}

    label = configuration.setup.label
    first = runner.run(serve.measured_load(cluster.url, cluster.api_key, WORKLOAD, on.calibration_rate, plan, progress,
                                           f"{label} · calibration", seed=CALIBRATION_SEED, warmed=taken))
    calibration_steps, loads, load_steps = taken(), [], []
    for rate in on.rates:
        loads.append(runner.run(serve.measured_load(cluster.url, cluster.api_key, WORKLOAD, rate, plan, progress, label,
                                                    warmed=taken)))
        load_steps.append(taken())
    return Measured(configuration, states, first, calibration_steps, loads, load_steps)


# -- the calibration ------------------------------------------------------------------------------


def calibrated(measured: Measured, model: str) -> Calibration:
    """The profile fitted to a configuration's calibration load, its KV in the blocks its engines
    used (their GET /v1/state's block size, which the simulated engines and the replay's pulls take)."""
    block_size, = {state["block_size"] for state in measured.states.values()}
    return calibrate(measured.calibration_load, measured.calibration_steps, kv_geometry(model), block_size)


# -- the variations -------------------------------------------------------------------------------


@dataclasses.dataclass
class Variation:
    suffix: str                        # of its keys: sim_error_<figure>_<configuration>_<rate><suffix>
    label: str
    costs: list[dict[str, StepCost]]   # one per load: engine id -> step cost
    paths: list[RequestPath]           # one per load
    link: LinkSpec
    summaries: list[dict]              # simulated(), one per load


def variations(calibration: Calibration, measured: Measured, model: str,
               in_process: StepCost | None) -> list[Variation]:
    """The replay with the calibrated profile, then with one assumption varied at a time: the step
    cost timed in process, no path and sim.link's default link (the simulator before), the default
    link alone, a constant path after the first token
    (its growth with the requests in flight left out), no path, the calibration's step costs with
    the prefill-sequence term, and each load's own step
    cost or own path measured on that load instead of the calibration's (how far the calibration
    load's figures carry to other rates), and both: the best the model's form reaches. Without an
    in-process profile of the model, no `_in_process`."""
    loads, n, none = measured.loads, len(measured.loads), RequestPath()
    engines, geometry = sim_engines(measured.configuration.topology, measured.states, model), kv_geometry(model)
    own_costs = [{e: calibration_fit(s)[0] for e, s in steps.items()} for steps in measured.load_steps]
    own_paths = [measured_path(load) for load in loads]
    with_f = {e: six_term_fit(s) for e, s in measured.calibration_steps.items()}
    constant = dataclasses.replace(calibration.path, last_token_lag_per_request_s=0.0)
    link, default = calibration.link, LinkSpec()
    plans = [("", "simulated", [calibration.costs] * n, [calibration.path] * n, link),
             ("_constant_path", "constant path", [calibration.costs] * n, [constant] * n, link),
             *([("_in_process", "in-process steps, no path", [dict.fromkeys(calibration.costs, in_process)] * n,
                 [none] * n, default)] if in_process else []),
             ("_no_path", "no path", [calibration.costs] * n, [none] * n, link),
             ("_default_link", "default link", [calibration.costs] * n, [calibration.path] * n, default),
             ("_with_f", "calibrated with f", [with_f] * n, [calibration.path] * n, link),
             ("_own_steps", "each load's own steps", own_costs, [calibration.path] * n, link),
             ("_own_path", "each load's own path", [calibration.costs] * n, own_paths, link),
             ("_own", "each load's own steps and path", own_costs, own_paths, link)]
    return [Variation(suffix, label, costs, paths, link,
                      [simulated(load, engines, cost, path, link, geometry)
                       for load, cost, path in zip(loads, costs, paths)])
            for suffix, label, costs, paths, link in plans]


# -- the replay -----------------------------------------------------------------------------------


def sim_requests(load: LoadResult) -> list[SimRequest]:
    """The requests a measured load sent, as it sent them: prompt and output lengths and scheduled
    arrivals. Ids are the load's indices, so a replayed request names the measured one."""
    sent = load.results
    return replay([r.arrival for r in sent], [r.prompt_tokens for r in sent], [r.max_tokens for r in sent],
                  [f"r{r.index}" for r in sent])


def simulated(load: LoadResult, engines: dict[str, tuple[str, EngineSpec, dict[str, str]]],
              costs: dict[str, StepCost], path: RequestPath = RequestPath(), link: LinkSpec = LinkSpec(),
              geometry: KVGeometry = KVGeometry()) -> dict:
    """The load replayed through a simulated cluster of `engines` (id -> role, spec, policies; the
    KV over `link`, pull mode), each with its cost, the tokens delivered through `path`:
    sim.metrics.summarise's figures, plus each engine's steps and the engine-side breakdown
    (`stages_ms`, before the path)."""
    requests = sim_requests(load)
    members = {e: (role, SimEngine(spec, costs[e], policies)) for e, (role, spec, policies) in engines.items()}
    start = time.perf_counter()
    sim_seconds = Cluster(members, link=link, geometry=geometry).run(requests)
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


def _result(quick: bool, on: ModelRun, plan: serve.Plan, replayed: list[Replayed],
            in_process: StepCost | None) -> BenchResult:
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
        configs[c.key] = _configuration_config(on.model, measured, calibration, found, stages, in_process)
    plotted = plot([float(r) for r in on.rates], "offered requests/s", tables,
                   f"{on.model}, 1 thread an engine, {WORKLOAD}: measured vs simulated "
                   f"(calibrated in service at {on.calibration_rate:g} req/s)",
                   PLOTS / f"sim_validation_{on.model}.png")
    worst = max(targets, key=lambda k: ratios[k] if not math.isnan(ratios[k]) else math.inf)
    met = sum(1 for k in targets if not math.isnan(ratios[k]) and ratios[k] <= TARGET)
    config = {"workload": WORKLOAD, "rates_rps": list(on.rates), "window_s": plan.window_s, "drain_s": plan.drain_s,
              "min_requests": plan.min_requests, "seed": serve.SEED, "model": on.model, "torch_threads": 1,
              "calibration_rate_rps": on.calibration_rate, "calibration_seed": CALIBRATION_SEED,
              "in_process_profile": on.in_process,
              "in_process_profile_path": str(profile_path(on.in_process)) if on.in_process else None,
              "in_process_step_cost": dataclasses.asdict(in_process) if in_process else None, "configurations": configs}
    return BenchResult(
        bench="sim", quick=quick, ratios=ratios, targets=targets, ceilings={},
        directions=dict.fromkeys(targets, "<="), config=config, rows=rows, plots=[plotted],
        headline=f"the simulator, calibrated on {on.model}'s engines in service ({WORKLOAD} at "
                 f"{on.calibration_rate:g} req/s), against {' and '.join(c.key for c in CONFIGURATIONS)} at "
                 f"{', '.join(f'{r:g}' for r in on.rates)} req/s: "
                 f"{met} of {len(targets)} errors within {TARGET:.0%}; the largest {worst} = {ratios[worst]:.2f}")


def _configuration_config(model: str, measured: Measured, calibration: Calibration, found: list[Variation],
                          stages: dict, in_process: StepCost | None) -> dict:
    engines = sim_engines(measured.configuration.topology, measured.states, model)
    plain = found[0].summaries
    return {
        "topology": measured.configuration.topology, "up_args": list(measured.configuration.setup.up_args),
        "calibration": {
            "requests": len(calibration.load.results), "failed": summarize(calibration.load)["failed"],
            "steps": {e: len(s) for e, s in calibration.steps.items()},
            "step_costs": {e: dataclasses.asdict(cost) for e, cost in calibration.costs.items()},
            "fits": calibration.fits, "request_path": dataclasses.asdict(calibration.path),
            "link": dataclasses.asdict(calibration.link),
            "profile_paths": [str(served_profile_path(model, measured.configuration.key, e))
                              for e in calibration.costs]},
        "engines": {e: {"role": role, **dataclasses.asdict(spec), "policies": policies}
                    for e, (role, spec, policies) in engines.items()},
        "engines_from": {"device_blocks": "GET /v1/state total_blocks.device",
                         "num_layers": f"{model}'s (its preset or checkpoint's config.json)",
                         "block_size": "GET /v1/state block_size", "max_num_seqs": "the engines' configuration",
                         "token_budget": "the engines' configuration (0: decided for the engine's role)",
                         "policies": "GET /v1/state, the hooks the simulator runs"},
        "variations": {v.suffix or "calibrated": {"label": v.label,
                                                  "step_costs": [{e: dataclasses.asdict(c) for e, c in costs.items()}
                                                                 for costs in v.costs],
                                                  "request_paths": [dataclasses.asdict(p) for p in v.paths],
                                                  "link": dataclasses.asdict(v.link)}
                       for v in found},
        "sim_per_wall": [s["sim_per_wall"] for s in plain],
        "preemptions_simulated": [s["preemptions"] for s in plain],
        "preemptions_measured": {e: state.get("preemptions", {}) for e, state in measured.states.items()},
        "engine_side_ms": stages,  # mean per request: the admission's timings_ms (measured) and the simulator's
        "engine_steps": {"measured": [{e: len(s) for e, s in steps.items()} for steps in measured.load_steps],
                         **{v.label: [s["steps"] for s in v.summaries] for v in found},
                         "note": "measured: the steps GET /v1/steps recorded over each load, after its 4 "
                                 "warm-up requests"},
        "step_ms_mean_measured": [{e: float(np.mean([x["seconds"] for x in s])) * 1e3 if s else math.nan
                                   for e, s in steps.items()} for steps in measured.load_steps],
        # how far each load's batches reach past the calibration's: the fit is linear beyond them
        "decode_tokens_per_step": {"calibration": {e: _spread(s) for e, s in calibration.steps.items()},
                                   "loads": [{e: _spread(s) for e, s in steps.items()}
                                             for steps in measured.load_steps]},
        "step_time_ratio": {"calibrated": [{e: step_time_ratio(calibration.costs[e], s) for e, s in steps.items()}
                                           for steps in measured.load_steps],
                            **({"in_process": [{e: step_time_ratio(in_process, s) for e, s in steps.items()}
                                               for steps in measured.load_steps]} if in_process else {}),
                            "note": "each load's recorded step seconds, summed, over what the cost says of "
                                    "their shapes"},
    }


def _spread(steps: list[dict]) -> dict[str, float]:
    """The decode tokens of the steps that decoded: their mean, 90th percentile and largest."""
    tokens = [s["decode_tokens"] for s in steps if s["decode_tokens"]]
    if not tokens:
        return {}
    return {"mean": float(np.mean(tokens)), "p90": float(np.percentile(tokens, 90)), "max": float(max(tokens))}
