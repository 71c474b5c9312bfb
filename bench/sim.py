"""`kvmesh bench sim`: the simulator (sim/) against `bench serve`'s colocated engine, issue 31 item 2.

One run calibrates, measures and then simulates, on one engine:
  0. calibration: `bench serve`'s configuration (3), one colocated engine (`kvmesh up --colocated`, the
     `tiny` preset, one torch thread), first serves a load of its own (`arxiv` at CALIBRATION_RATE,
     requests and arrivals of CALIBRATION_SEED, none of the validated loads'; serve's window). The
     profile is fitted to it (`calibrate()`): the step cost to the steps the engine recorded while it
     ran (`GET /v1/steps`, each the wall time of its loop's turn: sim.fit.fit_engine_steps), and the
     request's path outside the engine to the client's timings against the engine's own
     (sim.request_path.measure over the admission's per-request `timings_ms`);
  1. measured: the same engine driven by bench/serve.py's own `measured_load` on `arxiv` at each of
     the rates of serve's sweep up to 12 req/s (1, 4, 8, 12: the same in `--quick` and the full run;
     `--quick` has serve's quick windows, 8 s of arrivals, the full run serve's 20 s);
  2. simulated: every request each load sent, with its prompt and output length and its scheduled
     arrival (`RequestResult`), replayed through `sim.engine.SimEngine` with that profile, the engine
     configured as the real one (its device blocks and policies from its `GET /v1/state`, its layers
     from the preset, block size, sequence limit and token budget the EngineConfig defaults `kvmesh up`
     leaves), and its tokens delivered through the measured path (sim.request_path.delivered).
Keys, at every rate r of (1, 4, 8, 12), each a relative error |simulated - measured| / measured of the
completed requests' figures:
  sim_error_p90_ttft_colocated_<r>, sim_error_mean_tpot_colocated_<r>, sim_error_p90_e2e_colocated_<r>:
    target <= 0.15 each (issue 31's validation target names these three);
  sim_error_p50_ttft_colocated_<r>: reported, no target (the issue measures it but sets none).
Information, no target, the same keys with a suffix: the assumptions varied one at a time (VARIED):
`_in_process`, the in-process profile (PROFILE, Engine.step timed alone) and no path, the simulator
as it was; `_no_path`, the in-service step cost without the path; `_own_steps`, each load's step
cost fitted to that load's own steps; `_own_path`, each load's own measured path; `_own`, both (the
best the model's form reaches: a mean cost per step shape, a constant path). Also the engine
side (timings_ms against the simulated queue, prefill and decode), the steps each load ran against the
simulated steps, and how long each load's real steps took against what the calibrated cost says of
their shapes (`step_time_ratio`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np
import uvloop
from rich.progress import Progress

from kvmesh.infra.local.state import read_state
from kvmesh.sim.calibrate import engine_steps
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.fit import fit_engine_steps
from kvmesh.sim.metrics import summarise
from kvmesh.sim.request import SimRequest
from kvmesh.sim.request_path import RequestPath, delivered, measure, profile_entry
from kvmesh.sim.simulate import simulate
from kvmesh.sim.step_cost import TERMS, StepCost, load_profile, profile_path, write_profile
from kvmesh.sim.workload import replay

from . import serve
from .loadgen import LoadResult, breakdown, run_load, served_model, summarize
from .report import BenchResult, Row, save_figure
from .workloads import WORKLOADS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WORKLOAD = "arxiv"
RATES = (1, 4, 8, 12)            # serve's arxiv sweep up to 12 req/s, about 3/4 of one engine's capacity
CALIBRATION_RATE = 6             # req/s: between the validated rates, so its steps range from one request to batches
CALIBRATION_SEED = 11            # the calibration load's requests and arrivals (serve's loads: serve.SEED)
PROFILE = "tiny-cpu-bfloat16-1t"  # the in-process profile (kvmesh sim calibrate), the `_in_process` variation's
TARGET = 0.15                    # issue 31: relative error at most 15%
TARGETED = ("p90_ttft", "mean_tpot", "p90_e2e")
FIGURES = {  # key part: (sim.metrics.summarise's key in s, loadgen.summarize's key in ms)
    "p50_ttft": ("ttft_p50_s", "ttft_p50_ms"), "p90_ttft": ("ttft_p90_s", "ttft_p90_ms"),
    "mean_tpot": ("tpot_mean_s", None), "p90_e2e": ("e2e_p90_s", "e2e_p90_ms")}
PLOT = Path("bench-results/sim_validation.png")
SERVED_PROFILE = Path("bench-results/sim_profile_in_service.json")  # the profile the run calibrated
STAGES = ("prefill_queue", "prefill", "decode")  # a colocated engine's timings_ms (no transfer, no decode queue)


def run(quick: bool) -> BenchResult:
    plan = serve.QUICK if quick else serve.FULL
    loads: list[LoadResult] = []
    load_steps: list[list[dict]] = []
    with (asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, Progress(transient=True) as progress,
          tempfile.TemporaryDirectory(prefix="kvmesh-bench-sim-") as tmp,
          serve.started_together((serve.COLOCATED,), Path(tmp), progress) as clusters):
        cluster = clusters[serve.COLOCATED.key]
        engine = ServingEngine(*engine_endpoint(cluster.run_dir))
        state = engine.get("/v1/state")
        first = runner.run(calibration_load(cluster.url, cluster.api_key, plan, progress, warmed=engine.take))
        calibration = calibrate(first, engine.take())
        for rate in RATES:
            loads.append(runner.run(serve.measured_load(cluster.url, cluster.api_key, WORKLOAD, rate, plan,
                                                        progress, serve.COLOCATED.label)))
            load_steps.append(engine.take())
    spec, policies = engine_spec(state), sim_policies(state)
    write_served_profile(calibration, SERVED_PROFILE)
    found = variations(calibration, loads, load_steps, spec, load_profile(PROFILE), policies)
    return _result(quick, plan, calibration, loads, load_steps, found, spec, policies, state)


# -- the calibration ------------------------------------------------------------------------------


@dataclasses.dataclass
class Calibration:
    """The profile this run fits, before it validates: to the calibration load's steps and path."""

    cost: StepCost
    fit: dict             # sim.fit's summary of the fit to the steps
    path: RequestPath
    load: LoadResult
    steps: list[dict]     # as GET /v1/steps listed them


def calibrate(load: LoadResult, steps: list[dict]) -> Calibration:
    cost, fit = fit_engine_steps(steps)
    return Calibration(cost, fit, measured_path(load), load, steps)


def measured_path(load: LoadResult) -> RequestPath:
    """The path outside the engine over a load's completed requests: the client's TTFT and end to
    end against the engine's own arrival-to-first-token and decode (the admission's timings_ms)."""
    timed = [r for r in load.results if r.ok and r.kvmesh and r.kvmesh.get("timings_ms")]
    engine = [r.kvmesh["timings_ms"] for r in timed]
    return measure([r.ttft for r in timed], [r.e2e for r in timed],
                   [(t["prefill_queue"] + t["prefill"]) / 1e3 for t in engine], [t["decode"] / 1e3 for t in engine])


async def calibration_load(url: str, api_key: str, plan: serve.Plan, progress: Progress,
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
                          label=f"calibration · {WORKLOAD} @ {CALIBRATION_RATE} req/s")


def write_served_profile(calibration: Calibration, path: Path) -> None:
    """The calibrated profile as a file sim/ loads (step cost and request path), for `kvmesh sim run`."""
    load = calibration.load
    origin = f"least-squares fit to the {len(calibration.steps)} steps the engine recorded (GET /v1/steps) while " \
             f"serving bench sim's calibration load ({WORKLOAD} at {load.rate:g} req/s, seed {CALIBRATION_SEED})"
    path_origin = f"mean over the calibration load's {sum(r.ok for r in load.results)} completed requests of " \
                  f"the client's timings minus the engine's own (timings_ms), kvmesh bench sim"
    write_profile(path, calibration.cost, dict.fromkeys(TERMS, origin),
                  {"model": serve.MODEL, "threads": 1, "source": "engine service (kvmesh bench sim)",
                   "request_path": profile_entry(calibration.path, path_origin)}, calibration.fit)


# -- the variations -------------------------------------------------------------------------------


@dataclasses.dataclass
class Variation:
    suffix: str                 # of its keys: sim_error_<figure>_colocated_<rate><suffix>
    label: str
    costs: list[StepCost]       # one per load
    paths: list[RequestPath]    # one per load
    summaries: list[dict]       # simulated(), one per load


def variations(calibration: Calibration, loads: list[LoadResult], load_steps: list[list[dict]], spec: EngineSpec,
               in_process: StepCost, policies: dict[str, str]) -> list[Variation]:
    """The replay with the calibrated profile, then with one assumption varied at a time: the step
    cost timed in process and no path (the simulator before), no path, and each load's own step
    cost or own path measured on that load instead of the calibration's (how far the calibration
    load's figures carry to other rates), and both: the best the model's form reaches."""
    n, none = len(loads), RequestPath()
    own_costs = [fit_engine_steps(steps)[0] for steps in load_steps]
    own_paths = [measured_path(load) for load in loads]
    plans = [("", "simulated", [calibration.cost] * n, [calibration.path] * n),
             ("_in_process", "in-process steps, no path", [in_process] * n, [none] * n),
             ("_no_path", "no path", [calibration.cost] * n, [none] * n),
             ("_own_steps", "each load's own steps", own_costs, [calibration.path] * n),
             ("_own_path", "each load's own path", [calibration.cost] * n, own_paths),
             ("_own", "each load's own steps and path", own_costs, own_paths)]
    return [Variation(suffix, label, costs, paths,
                      [simulated(load, spec, cost, policies, path) for load, cost, path in zip(loads, costs, paths)])
            for suffix, label, costs, paths in plans]


def step_time_ratio(cost: StepCost, steps: list[dict]) -> float:
    """How long steps took, all together, against what `cost` says of their shapes."""
    predicted = sum(cost.seconds(s["prefill_tokens"], s["decode_tokens"], s["decode_context"], s["prefill_context"])
                    for s in steps)
    return sum(s["seconds"] for s in steps) / predicted if predicted > 0 else math.nan


# -- the real engine ------------------------------------------------------------------------------


def engine_endpoint(run_dir: Path) -> tuple[str, str]:
    """The colocated engine's URL and the cluster's service token."""
    cluster = read_state(run_dir)
    engine = next(c for c in cluster.children if c.name.startswith("engine"))
    return engine.url.rstrip("/"), Path(cluster.token_file).read_text().strip()


@dataclasses.dataclass
class ServingEngine:
    """An engine's REST API, and the steps it recorded, taken a load at a time."""

    url: str
    token: str
    since: int = 0

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def take(self) -> list[dict]:
        """The steps since the last take."""
        steps = engine_steps(self.url, self.since, self.token)
        self.since = steps[-1]["index"] if steps else self.since
        return steps


def engine_spec(state: dict) -> EngineSpec:
    """The simulated engine as the real one: device blocks from its state, layers from the preset it
    runs, block size, sequence limit and token budget as EngineConfig and its defaults leave them
    (`kvmesh up` sets none of them)."""
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.engine.defaults import token_budget
    from kvmesh.services.engine.native.models.presets import PRESETS

    config = EngineConfig(model=serve.MODEL)
    return EngineSpec(block_size=config.block_size, num_layers=PRESETS[serve.MODEL].num_layers,
                      device_blocks=int(state["total_blocks"]["device"]), max_num_seqs=config.max_num_seqs,
                      token_budget=config.token_budget or token_budget(config.role))


def sim_policies(state: dict) -> dict[str, str]:
    """The engine's policies for the hooks the simulator runs."""
    from kvmesh.sim.engine import HOOKS

    return {hook: name for hook, name in state.get("policies", {}).items() if hook in HOOKS}


# -- the replay -----------------------------------------------------------------------------------


def sim_requests(load: LoadResult) -> list[SimRequest]:
    """The requests a measured load sent, as it sent them: prompt and output lengths and scheduled
    arrivals. Ids are the load's indices, so a replayed request names the measured one."""
    sent = load.results
    return replay([r.arrival for r in sent], [r.prompt_tokens for r in sent], [r.max_tokens for r in sent],
                  [f"r{r.index}" for r in sent])


class CountingEngine(SimEngine):
    """A SimEngine that counts its steps, to hold against the real engine's."""

    steps = 0

    def complete(self, step, done: float) -> None:
        self.steps += 1
        super().complete(step, done)


def simulated(load: LoadResult, spec: EngineSpec, cost: StepCost, policies: dict[str, str],
              path: RequestPath = RequestPath()) -> dict:
    """The load replayed through a simulated engine, its tokens delivered through `path`:
    sim.metrics.summarise's figures, plus its steps and the engine-side breakdown (`stages_ms`, as
    the admission's timings_ms of a colocated engine, before the path)."""
    requests = sim_requests(load)
    engine = CountingEngine(spec, cost, policies)
    start = time.perf_counter()
    sim_seconds = simulate(engine, requests)
    wall = time.perf_counter() - start
    stages = sim_stages(requests)
    delivered(requests, path)
    return {**summarise(requests, sim_seconds, wall), "steps": engine.steps, "stages_ms": stages}


def sim_stages(requests: list[SimRequest]) -> dict[str, float]:
    """Mean ms from reaching the engine to first blocks (prefill_queue), to the first token (prefill),
    to the last (decode), over the finished requests: the engine's Timings, as simulated."""
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


def relative_error(simulated_value: float, measured_value: float) -> float:
    if math.isnan(simulated_value) or math.isnan(measured_value) or measured_value == 0:
        return math.nan
    return abs(simulated_value - measured_value) / measured_value


# -- the result -----------------------------------------------------------------------------------


def _result(quick: bool, plan: serve.Plan, calibration: Calibration, loads: list[LoadResult],
            load_steps: list[list[dict]], found: list[Variation], spec: EngineSpec, policies: dict[str, str],
            state: dict) -> BenchResult:
    rows, ratios, targets, stages = [], {}, {}, {}
    table = {label: {n: [] for n in FIGURES} for label in ["measured", *(v.label for v in found)]}
    for i, load in enumerate(loads):
        rate = f"{load.rate:g}"
        real = measured_figures(load)
        for label, figures, failed in (("measured", real, summarize(load)["failed"]),
                                       *((v.label, sim_figures(v.summaries[i]), v.summaries[i]["unfinished"])
                                         for v in found)):
            rows.append(Row(compared=label, path=f"{WORKLOAD} @ {rate} req/s ({len(load.results)} requests)",
                            cells={**{f"{n.replace('_', ' ')} ms": figures[n] * 1e3 for n in FIGURES},
                                   "failed": float(failed)}))
            for n in FIGURES:
                table[label][n].append(figures[n])
        for n in FIGURES:
            key = f"sim_error_{n}_colocated_{rate}"
            for v in found:
                ratios[f"{key}{v.suffix}"] = relative_error(sim_figures(v.summaries[i])[n], real[n])
            if n in TARGETED:
                targets[key] = TARGET
        stages[rate] = {"measured": {k: v for k, v in (breakdown(load) or {}).items() if k in STAGES},
                        **{v.label: v.summaries[i]["stages_ms"] for v in found}}
        for label in ("measured", found[0].label):
            rows.append(Row(compared=f"{label}, engine side", path=f"{WORKLOAD} @ {rate} req/s, mean per request",
                            cells={f"{k.replace('_', ' ')} ms": v for k, v in stages[rate][label].items()}))
        rows.append(Row(compared="relative error", path=f"{WORKLOAD} @ {rate} req/s",
                        cells={f"{n.replace('_', ' ')} ms": ratios[f"sim_error_{n}_colocated_{rate}"]
                               for n in FIGURES}))
    plot = _plot([load.rate for load in loads], table)
    worst = max(targets, key=lambda k: ratios[k] if not math.isnan(ratios[k]) else math.inf)
    met = sum(1 for k in targets if not math.isnan(ratios[k]) and ratios[k] <= TARGET)
    in_process = load_profile(PROFILE)
    config = {
        "workload": WORKLOAD, "rates_rps": list(RATES), "window_s": plan.window_s, "drain_s": plan.drain_s,
        "min_requests": plan.min_requests, "seed": serve.SEED, "model": serve.MODEL, "torch_threads": 1,
        "calibration": {
            "rate_rps": CALIBRATION_RATE, "seed": CALIBRATION_SEED, "requests": len(calibration.load.results),
            "failed": summarize(calibration.load)["failed"], "steps": len(calibration.steps),
            "step_cost": dataclasses.asdict(calibration.cost), "fit": calibration.fit,
            "request_path": dataclasses.asdict(calibration.path), "profile_path": str(SERVED_PROFILE)},
        "in_process_profile": PROFILE, "in_process_profile_path": str(profile_path(PROFILE)),
        "in_process_step_cost": dataclasses.asdict(in_process),
        "engine": {**dataclasses.asdict(spec), "from": {
            "device_blocks": "GET /v1/state total_blocks.device", "num_layers": f"the {serve.MODEL} preset",
            "block_size": "EngineConfig default", "max_num_seqs": "EngineConfig default",
            "token_budget": "EngineConfig default (0), decided for role both"}},
        "policies": policies, "engine_policies": state.get("policies", {}),
        "variations": {v.suffix or "calibrated": {"label": v.label,
                                                  "step_costs": [dataclasses.asdict(c) for c in v.costs],
                                                  "request_paths": [dataclasses.asdict(p) for p in v.paths]}
                       for v in found},
        "sim_per_wall": [s["sim_per_wall"] for s in found[0].summaries],
        "preemptions_simulated": [s["preemptions"] for s in found[0].summaries],
        "preemptions_measured": state.get("preemptions", {}),
        "engine_side_ms": stages,  # mean per request: the admission's timings_ms (measured) and the simulator's
        "engine_steps": {"measured": [len(steps) for steps in load_steps],
                         **{v.label: [s["steps"] for s in v.summaries] for v in found},
                         "note": "measured: the steps GET /v1/steps recorded over each load, its 4 warm-up "
                                 "requests included"},
        "step_ms_mean_measured": [float(np.mean([s["seconds"] for s in steps])) * 1e3 if steps else math.nan
                                  for steps in load_steps],
        "step_time_ratio": {"calibrated": [step_time_ratio(calibration.cost, steps) for steps in load_steps],
                            "in_process": [step_time_ratio(in_process, steps) for steps in load_steps],
                            "note": "each load's recorded step seconds, summed, over what the cost says of "
                                    "their shapes"},
    }
    return BenchResult(
        bench="sim", quick=quick, ratios=ratios, targets=targets, ceilings={},
        directions=dict.fromkeys(targets, "<="), config=config, rows=rows, plots=[plot],
        headline=f"the simulator, calibrated on the engine in service ({WORKLOAD} at {CALIBRATION_RATE} req/s), "
                 f"against one colocated engine at {', '.join(map(str, RATES))} req/s: {met} of {len(targets)} "
                 f"errors within {TARGET:.0%}; the largest {worst} = {ratios[worst]:.2f}")


def _plot(rates: list[float], table: dict[str, dict[str, list[float]]]) -> str:
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4.2 * len(FIGURES), 3.8))
    markers = ("o", "s", "^", "v", "D", "x", "P")
    for ax, name in zip(axes, FIGURES):
        for (label, figures), marker in zip(table.items(), markers):
            ax.plot(rates, np.asarray(figures[name]) * 1e3, label=label, marker=marker,
                    linestyle="-" if label in ("measured", "simulated") else ":")
        ax.set_title(name.replace("_", " "))
        ax.set_xlabel("offered requests/s")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"one colocated engine (tiny, 1 thread), {WORKLOAD}: measured vs simulated "
                 f"(calibrated in service at {CALIBRATION_RATE} req/s)")
    return save_figure(fig, PLOT)
