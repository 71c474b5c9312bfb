"""`kvmesh bench sim_layerkv`: the simulator (sim/) against `bench layerkv`'s runs, issue 31 item 2.

bench layerkv serves in process (bench/cacheopt_serving.py's replay, the `small` model, 8 layers),
FCFS with every layer on the device against LayerKV's layer offload without and with its SLO-aware
admission, on A (prompts of one context length, 128-token answers) and B (real instructions at a
share of FCFS's capacity on them), every request with its SLOs and predicted output-length range.
This bench runs the same sweep (bench.layerkv.sweep; `--quick` its quick shape: A, 4 requests of
1536-token prompts at FCFS's capacity on them; B, 12 instructions at 3x; one torch thread), with
LayerKV's decodes in `--layer-decode`'s mode (bench layerkv's: restore, the default, or stage), and:
  0. measured: bench layerkv's sweep, each run with its arrivals, targets and steps;
  1. calibration: after the sweep (it needs the sweep's rates), FCFS serves requests of its own
     shaped and arriving as the sweep's: CALIBRATION_SEED's A-shaped requests (1536-token prompts) at
     A's rate, then its instructions at B's first share of capacity, each a Poisson process of the
     seed, and LayerKV's layer offload serves the A-shaped ones again (its staged steps); each turn
     that stepped is recorded and the step cost fitted to them (five terms and the staged bytes' g,
     sim_validation.calibration_fit). All at once, as before, the instructions were prefilled packed
     with the long prompts into the budget's steps: the cost had no short prefill to fit, and B's
     prefill steps took 3.6-3.7x what it said of them;
  2. simulated: each run replayed (bench/sim_replay.py) through a SimEngine configured from the
     method's engine: its pools, budget and policies, and with layer offload on, the staging area,
     Eq. 5's parameters, Eq. 3 and 4's fits (the sweep's one profile), layer copies at Eq. 4's
     measured device -> cxl bandwidth. The simulator overlaps a staged layer's copies with the
     compute (a side stream, as on a GPU); the CPU engine here copies them inline, in its steps.
Keys, for each method m (fcfs, layerkv_noslo, layerkv) and run (a<context>, b<share>x):
  sim_error_{p90_ttft,mean_tpot,p90_e2e}_<m>_<run>: target <= 0.15; sim_error_p50_ttft_...: no target.
Information, one assumption varied at a time: `_rescaled`, `_own_steps` (as bench sim_cacheopt's),
`_relative_fit` (the calibration's steps fitted in relative error, each step alike: short prefills
weigh as much as the 1536-token ones), `_with_f` (the calibration fitted with the
prefill-sequence term f: six terms, where the calibrated has five), `_without_g` (the calibration
fitted without the staged bytes' term g, as before it), `_inline_copies` (LayerKV's
engines: a staged layer's copies in its step, as the CPU engine copies, not overlapped);
sim_elasticity_...; the layers each run offloaded, measured and simulated. With 4 and 12 requests a
run, a P90 is one request's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from kvmesh.libs.messages.engine import Targets
from kvmesh.policies.offload import LayerDecode
from kvmesh.services.engine.native.engine import Engine
from kvmesh.sim.fit import fit_engine_steps
from kvmesh.sim.step_cost import StepCost

from . import layerkv
from .cacheopt_serving import RunStats, replay
from .instruction_trace import instruction_trace
from .loadgen import poisson_arrivals
from .layerkv_traces import fixed
from .report import BenchResult, Row
from .sim_replay import (SENSITIVITY, Configured, Variation, calibration_variants, configured, figures, keys,
                         variations)
from .sim_validation import FIGURES, HELD, TARGET, calibration_fit, plot, step_time_ratio

CALIBRATION_SEED = 11   # its requests (the sweep's: A seed 1, B seed 2)
PLOT = Path("bench-results/sim_layerkv.png")
PLOTTED = ("measured", "simulated", "calibrated, rescaled to the run", "the run's own steps")


def run(quick: bool, layer_decode: LayerDecode = "restore") -> BenchResult:
    torch.set_num_threads(1 if quick else layerkv.THREADS)
    served = layerkv.sweep(quick, layer_decode)
    calibration = calibration_run(served)
    steps = [step for part in calibration for step in part.steps]
    engines = {method: configured_engine(method, layer_decode, served.profile) for method in layerkv.METHODS}
    calibrated, fit = calibration_fit(steps)
    without_g = fit_engine_steps(steps, held=(*HELD, "g"))[0]
    others = [*calibration_variants(steps), ("_without_g", "calibration without the staged bytes' term g", without_g)]
    replays = {(method, name): (stats, variations(stats, requests, max(r.output_len for r in requests),
                                                  engines[method], calibrated, others))
               for (method, name), (requests, stats) in served.runs.items()}
    return _result(quick, served, engines, calibration, calibrated, fit, replays)


def calibration_run(served: layerkv.Sweep) -> list[RunStats]:
    """Requests of its own served as the sweep's two parts arrive, each part on a fresh engine: FCFS
    on A-shaped ones of the longest context at A's rate and on instructions at B's first share of
    capacity, as many as a run of each, so that its steps have the runs' shapes (a short prompt
    prefilled beside a few decodes, as in B); and LayerKV's layer offload (without Algorithm 1) on
    the A-shaped ones again, whose staged steps price the bytes a step copies through its staging
    area (the step cost's g)."""
    a_shaped = fixed(served.n_a, layerkv.LONGEST, seed=CALIBRATION_SEED)
    instructions = instruction_trace("serve", served.n_b, output_scale=layerkv.B_OUTPUT_SCALE, seed=CALIBRATION_SEED)
    parts = (("fcfs", a_shaped, served.rate_a), ("fcfs", instructions, served.rates_b[0] * served.capacity_b),
             ("layerkv-noslo", a_shaped, served.rate_a))
    return [_calibration_part(layerkv.method_engine(method, served.layer_decode, served.profile), requests, rate)
            for method, requests, rate in parts]


def _calibration_part(engine: Engine, requests: list, rate: float) -> RunStats:
    try:
        return replay(engine, requests, poisson_arrivals(len(requests), rate, seed=CALIBRATION_SEED),
                      [Targets()] * len(requests), max(r.output_len for r in requests))
    finally:
        if engine.runner.staging is not None:
            engine.runner.staging.close()


def configured_engine(method: str, layer_decode: LayerDecode, profile: list) -> Configured:
    """The method's engine as the simulator configures it (LayerKV's fits the sweep's profile, its
    decodes' mode in the spec's offload parameters)."""
    engine = layerkv.method_engine(method, layer_decode, profile)
    try:
        return configured(engine)
    finally:
        if engine.runner.staging is not None:
            engine.runner.staging.close()


def run_name(method: str, name: str) -> str:
    """A run in keys: `layerkv_noslo_a1536`, `fcfs_b3x`."""
    return f"{method.replace('-', '_')}_{name.replace(' ', '').lower()}"


Replays = dict[tuple[str, str], tuple[RunStats, list[Variation]]]


def _result(quick: bool, served: layerkv.Sweep, engines: dict[str, Configured], calibration: list[RunStats],
            calibrated: StepCost, fit: dict, replays: Replays) -> BenchResult:
    rows, ratios, targets, tables, runs = [], {}, {}, {}, {}
    for (method, name), (stats, found) in replays.items():
        key = run_name(method, name)
        real = figures(stats)
        table = tables.setdefault(name, {label: {n: [] for n in FIGURES} for label in PLOTTED})
        for label, values, run in (("measured", real, stats), *((v.label, figures(v.stats), v.stats) for v in found)):
            if label in PLOTTED:
                rows.append(Row(compared=label, path=f"{method}, {name}",
                                cells={**{f"{n.replace('_', ' ')} ms": values[n] * 1e3 for n in FIGURES},
                                       "preempt": float(sum(run.preemptions.values()))}))
                for n in FIGURES:
                    table[label][n].append(values[n])
        run_ratios, run_targets = keys(key, stats, found)
        ratios |= run_ratios
        targets |= run_targets
        rows.append(Row(compared="relative error", path=f"{method}, {name}",
                        cells={f"{n.replace('_', ' ')} ms": ratios[f"sim_error_{n}_{key}"] for n in FIGURES}))
        runs[key] = {"requests": len(stats.served), "measured_steps": len(stats.steps),
                     "step_time_ratio_calibrated": step_time_ratio(calibrated, stats.steps),
                     "preemptions_measured": stats.preemptions,
                     "layers_offloaded_measured": _measured_offloads(served, method, name),
                     "variations": {v.suffix or "calibrated": {"label": v.label, "preemptions": v.stats.preemptions,
                                                               "step_cost": dataclasses.asdict(v.cost), **v.info}
                                    for v in found}}
    worst = max(targets, key=lambda k: ratios[k] if not math.isnan(ratios[k]) else math.inf)
    met = sum(1 for k in targets if not math.isnan(ratios[k]) and ratios[k] <= TARGET)
    config = {"model": layerkv.MODEL, "torch_threads": torch.get_num_threads(), "layer_decode": served.layer_decode,
              "contexts": list(served.contexts),
              "rates_b": [s * served.capacity_b for s in served.rates_b], "rate_a": served.rate_a,
              "requests_a": served.n_a, "requests_b": served.n_b,
              "engines": {m: {**dataclasses.asdict(c.spec), "policies": c.policies} for m, c in engines.items()},
              "calibration": {"seed": CALIBRATION_SEED, "requests": sum(len(part.served) for part in calibration),
                              "steps": sum(len(part.steps) for part in calibration),
                              "step_cost": dataclasses.asdict(calibrated),
                              "fit": fit},
              "sensitivity": SENSITIVITY, "runs": runs}
    # A row of panels for each part of the sweep, the methods (in the sweep's order) along the x axis.
    plotted = plot(list(range(len(layerkv.METHODS))),
                   " | ".join(f"{i}: {m}" for i, m in enumerate(layerkv.METHODS)), tables,
                   f"{layerkv.MODEL}, bench layerkv's runs: measured vs simulated", PLOT)
    return BenchResult(
        bench="sim_layerkv", quick=quick, ratios=ratios, targets=targets, ceilings={},
        directions=dict.fromkeys(targets, "<="), config=config, rows=rows, plots=[plotted],
        headline=f"the simulator, calibrated on the in-process engine's steps, against bench layerkv's runs "
                 f"({', '.join(layerkv.METHODS)}): {met} of {len(targets)} errors within {TARGET:.0%}; "
                 f"the largest {worst} = {ratios[worst]:.2f}")


def _measured_offloads(served: layerkv.Sweep, method: str, name: str) -> dict[str, int]:
    """The layers the measured run offloaded (admitted and forecast) and brought back."""
    part, at = name.split(" ")
    metrics = served.a[(method, int(at))] if part == "A" else served.b[(method, float(at.rstrip("x")))]
    return {"offloaded": metrics.layers_offloaded, "restored": metrics.layers_restored}
