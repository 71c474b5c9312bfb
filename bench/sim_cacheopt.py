"""`kvmesh bench sim_cacheopt`: the simulator (sim/) against `bench cacheopt`'s runs, issue 31 item 2.

bench cacheopt serves the instruction trace with kvmesh's native engine in process
(bench/cacheopt_serving.py: the `tiny` model computes every step; idle time before an arrival is
skipped), each allocation method at fractions of the block baseline's capacity, every request with
its SLOs and its method's estimated output length. This bench runs the same sweep (bench cacheopt's
own functions; `--quick` its quick shape: 40 requests, block, rlp, s3 and cacheopt at 0.6 and 1.2
of capacity, one torch thread; the full run its full shape, the ablations too), and:
  0. calibration: before the sweep, the block baseline serves a load of its own (CALIBRATION_SEED's
     requests and arrivals at CALIBRATION_FRACTION of capacity, no estimate, no SLO). Each turn of
     the replay's loop that computed a step is recorded as the engine service records its own
     (services/engine/steps.py: the step's shape, the turn's seconds), and the step cost is fitted
     to them (five terms, sim_validation.calibration_fit, as bench sim fits an engine in service);
  1. measured: bench cacheopt's sweep (bench.cacheopt.sweep), each run with the arrivals and
     targets it gave its requests and the steps it took;
  2. simulated: each run's requests replayed through one SimEngine configured as the method's
     engine (one is built to read it: pools, block size and bytes, token budget, sequence limit, the
     policies of the hooks the simulator runs, the allocation ledger's parameters), each request
     with its arrival, prompt and output length, SLOs and estimated length as it was given them. It
     ends at its trace length while its policies read the max_tokens it was sent with (the trace's
     longest), as in the measured run. A swap copies at the rate the engine's swap profile measured
     (CacheOpt 3.5's L_s; the engines whose strategy reads no curve never swap). The profile's sweet
     spot on this CPU is 0 tokens, so `sweet_spot` swaps every victim the cxl tier has room for,
     which is what it does in the simulator, whose pools give no curves.
Keys, for each method m and rate r (the fraction of capacity), each a relative error
|simulated - measured| / measured over the run's requests:
  sim_error_{p90_ttft,mean_tpot,p90_e2e}_<m>_<r>: target <= 0.15 each;
  sim_error_p50_ttft_<m>_<r>: reported, no target.
Information, the same keys with a suffix, one assumption varied at a time (bench/sim_replay.py):
`_rescaled`, the calibrated cost scaled to the run's own steps' total (the machine's speed in that
run); `_own_steps`, each run's step cost fitted to its own steps (the best the cost's form
reaches); `_relative_fit`, the calibration fitted in relative error; `_with_f`, the calibration
fitted with the prefill-sequence term f (six terms; the calibrated cost holds it at 0); `_in_process`, the in-process
profile (PROFILE: Engine.step timed alone at a few shapes); and sim_elasticity_<figure>_<m>_<r>,
a figure's relative change over the step cost's. CacheOpt's own figures beside them: P99 TBT and
SLO attainment, measured and simulated, and each method's preemptions.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from kvmesh.libs.messages.engine import Targets
from kvmesh.services.predictor.encoder import encoder
from kvmesh.sim.step_cost import StepCost, load_profile

from . import cacheopt
from .cacheopt_serving import RunStats, capacity, replay
from .instruction_trace import TraceRequest
from .loadgen import poisson_arrivals
from .report import BenchResult, Row
from .sim_replay import (SENSITIVITY, Configured, Variation, calibration_variants, configured, figures, keys,
                         variations)
from .sim_validation import FIGURES, TARGET, calibration_fit, plot, step_time_ratio

CALIBRATION_FRACTION = 0.9  # of capacity: between the validated rates, so its steps range from one request to batches
CALIBRATION_SEED = 11       # its requests and arrivals (the sweep's: requests seed 1, arrivals seed 2)
PROFILE = "tiny-cpu-bfloat16-1t"  # the in-process profile (kvmesh sim calibrate), the `_in_process` variation's
PLOT = Path("bench-results/sim_cacheopt.png")
PLOTTED = ("measured", "simulated", "calibrated, rescaled to the run", "the run's own steps")


@dataclasses.dataclass(frozen=True)
class Shape:
    """bench cacheopt's run: --quick or full."""

    requests: int
    train: int | None
    fractions: tuple[float, ...]
    methods: tuple[cacheopt.Method, ...]
    threads: int
    capacity_runs: int


QUICK = Shape(40, 200, cacheopt.RATE_FRACTIONS[::2], cacheopt.MAIN, 1, 1)
FULL = Shape(150, None, cacheopt.RATE_FRACTIONS, cacheopt.MAIN + cacheopt.ABLATIONS, 2, cacheopt.CAPACITY_RUNS)


def run(quick: bool) -> BenchResult:
    shape = QUICK if quick else FULL
    torch.set_num_threads(shape.threads)
    measured = measure(shape)
    calibrated, fit = calibration_fit(measured.calibration.steps)
    others = [*calibration_variants(measured.calibration.steps), ("_in_process", "in-process steps",
                                                                   load_profile(PROFILE))]
    replays = []
    for (method, rate), stats in measured.runs.items():
        fraction = shape.fractions[measured.rates.index(rate)]
        replays.append(Replayed(method, fraction, stats,
                                variations(stats, measured.requests, measured.trace.output.high,
                                           measured.engines[method], calibrated, others)))
    return _result(quick, shape, measured, replays, calibrated, fit)


# -- the measured runs ----------------------------------------------------------------------------


@dataclasses.dataclass
class Measured:
    trace: cacheopt.InstructionTrace
    requests: list[TraceRequest]
    capacity_rps: float
    rates: list[float]
    calibration: RunStats
    runs: dict[tuple[str, float], RunStats]   # (method, rate) -> the run
    engines: dict[str, Configured]            # method -> its engine, as the simulator configures it
    slos: cacheopt.Slos


def measure(shape: Shape) -> Measured:
    """bench cacheopt's sweep, its steps recorded, after a calibration run of the block baseline."""
    trace = cacheopt.TRACES["instructions"]
    high = trace.output.high
    with Progress(transient=True) as progress:
        task = progress.add_task("predictor", total=None)
        requests = trace.requests(shape.requests, seed=1)
        predicted = cacheopt.predictions(trace, requests, shape.train, encoder())
        progress.update(task, description="capacity",
                        total=(len(shape.methods) * len(shape.fractions) + shape.capacity_runs + 1) * len(requests))
        block = cacheopt.MAIN[0]
        per_s = capacity(cacheopt.method_engine(trace, block), requests, [Targets()] * len(requests), high,
                         shape.capacity_runs, lambda: progress.advance(task))
        progress.update(task, description="calibration")
        own = trace.requests(shape.requests, seed=CALIBRATION_SEED)
        calibration = replay(cacheopt.method_engine(trace, block), own,
                             poisson_arrivals(len(own), CALIBRATION_FRACTION * per_s, seed=CALIBRATION_SEED),
                             [Targets()] * len(own), high, lambda: progress.advance(task))
        rates = [per_s * f for f in shape.fractions]
        slos = cacheopt.Slos(trace, requests)
        runs = cacheopt.sweep(trace, requests, predicted, shape.methods, rates, slos, progress, task)
    engines = {m.name: configured(cacheopt.method_engine(trace, m)) for m in shape.methods}
    return Measured(trace, requests, per_s, rates, calibration, runs, engines, slos)


def key_name(method: str) -> str:
    """A method's name in keys: the ablations' `/CKA` as `no_cka`, `+VG` as `with_vg`."""
    return method.replace("/", "no_").replace("+", "with_").lower()


# -- the result -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Replayed:
    method: str
    fraction: float
    stats: RunStats
    variations: list[Variation]


def _result(quick: bool, shape: Shape, measured: Measured, replays: list[Replayed], calibrated: StepCost,
            fit: dict) -> BenchResult:
    rows, ratios, targets, tables, runs = [], {}, {}, {}, {}
    for r in replays:
        rate = measured.rates[shape.fractions.index(r.fraction)]
        where = f"{r.method} at {r.fraction:g} x capacity ({rate:.1f} req/s)"
        name = f"{key_name(r.method)}_{r.fraction:g}"
        real, found = figures(r.stats), {v.suffix: figures(v.stats) for v in r.variations}
        metrics = {"measured": cacheopt.metrics_of(r.stats, measured.slos),
                   **{v.label: _metrics(v.stats, measured.slos) for v in r.variations}}
        table = tables.setdefault(r.method, {label: {n: [] for n in FIGURES} for label in PLOTTED})
        for label, values, stats in (("measured", real, r.stats),
                                     *((v.label, found[v.suffix], v.stats) for v in r.variations)):
            if label in PLOTTED:
                rows.append(Row(compared=label, path=where, cells=_cells(values, metrics[label], stats)))
                for n in FIGURES:
                    table[label][n].append(values[n])
        run_ratios, run_targets = keys(name, r.stats, r.variations)
        ratios |= run_ratios
        targets |= run_targets
        rows.append(Row(compared="relative error", path=where,
                        cells={f"{n.replace('_', ' ')} ms": ratios[f"sim_error_{n}_{name}"] for n in FIGURES}))
        runs[name] = _run_config(r, calibrated, metrics)
    worst = max(targets, key=lambda k: ratios[k] if not math.isnan(ratios[k]) else math.inf)
    met = sum(1 for k in targets if not math.isnan(ratios[k]) and ratios[k] <= TARGET)
    engines = {m: {**dataclasses.asdict(c.spec), "policies": c.policies, "allocation": dataclasses.asdict(c.allocation)}
               for m, c in measured.engines.items()}
    config = {"requests_per_run": shape.requests, "train_requests": shape.train, "torch_threads": shape.threads,
              "rate_fractions_of_capacity": list(shape.fractions), "capacity_rps": measured.capacity_rps,
              "rates_rps": measured.rates, "methods": [m.name for m in shape.methods], "engines": engines,
              "slos": {"mean_ttft_ms": measured.slos.mean_ttft_ms, "mean_tbt_ms": measured.slos.mean_tbt_ms},
              "calibration": {"fraction_of_capacity": CALIBRATION_FRACTION, "seed": CALIBRATION_SEED,
                              "steps": len(measured.calibration.steps), "step_cost": dataclasses.asdict(calibrated),
                              "fit": fit, "preemptions": measured.calibration.preemptions},
              "in_process_profile": PROFILE, "sensitivity": SENSITIVITY, "runs": runs}
    plot_path = plot(list(shape.fractions), "offered rate / block baseline's capacity", tables,
                     f"tiny, {shape.threads} thread(s), bench cacheopt's runs: measured vs simulated "
                     f"(calibrated on the block baseline at {CALIBRATION_FRACTION:g} x capacity)", PLOT)
    return BenchResult(
        bench="sim_cacheopt", quick=quick, ratios=ratios, targets=targets, ceilings={},
        directions=dict.fromkeys(targets, "<="), config=config, rows=rows, plots=[plot_path],
        headline=f"the simulator, calibrated on the in-process engine's steps, against bench cacheopt's "
                 f"{', '.join(m.name for m in shape.methods)} at {', '.join(f'{f:g}' for f in shape.fractions)} x "
                 f"capacity: {met} of {len(targets)} errors within {TARGET:.0%}; the largest {worst} = "
                 f"{ratios[worst]:.2f}")


def _metrics(stats: RunStats, slos: cacheopt.Slos) -> cacheopt.Metrics | None:
    """CacheOpt's figures of a run, unless a request of it did not finish."""
    return cacheopt.metrics_of(stats, slos) if all(s.times for s in stats.served) else None


def _cells(values: dict[str, float], metrics: cacheopt.Metrics | None, stats: RunStats) -> dict[str, float]:
    return {**{f"{n.replace('_', ' ')} ms": values[n] * 1e3 for n in FIGURES},
            "p99 TBT ms": metrics.p99_tbt_ms if metrics else math.nan,
            "SLO": metrics.slo_attainment if metrics else math.nan,
            "preempt": float(sum(stats.preemptions.values()))}


def _run_config(r: Replayed, calibrated: StepCost, metrics: dict[str, cacheopt.Metrics | None]) -> dict:
    steps = r.stats.steps
    return {
        "measured_steps": len(steps),
        "step_ms_mean_measured": float(np.mean([s["seconds"] for s in steps])) * 1e3 if steps else math.nan,
        "step_time_ratio_calibrated": step_time_ratio(calibrated, steps),
        "preemptions_measured": r.stats.preemptions,
        "variations": {v.suffix or "calibrated": {"label": v.label, "step_cost": dataclasses.asdict(v.cost),
                                                  "preemptions": v.stats.preemptions, **v.info}
                       for v in r.variations},
        "cacheopt_figures": {label: None if m is None else dataclasses.asdict(m) for label, m in metrics.items()},
    }
