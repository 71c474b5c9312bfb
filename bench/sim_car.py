"""`kvmesh bench sim_car`: the simulator (sim/) against `bench car`'s runs, issue 31 item 2.

bench car serves in process (the `small` model, 8 layers): recomputing, a device-only LRU prefix
cache, CaR's cxl tier of nodes, and CaR with its scheduler (classes, the Shuffled Window, fetch(t)
prefetch), on a multi-turn workload (closed-loop conversations) and on shared system prompts (4
clients). This bench runs those eight (bench.car.serve_multi_turn and serve_system_prompts; `--quick`
bench car's quick shape: 3 conversations of 4 turns, 24 system-prompt requests, one torch thread), and:
  0. calibration: first the recomputing engine serves conversations and system prompts of its own
     (CALIBRATION_SEED), every step timed; the step cost is fitted to them (five terms, sim_validation.calibration_fit);
  1. measured: the eight runs, each request's arrival, token ids and token times, each step timed;
  2. simulated: each run replayed (bench/sim_replay.py) through a SimEngine configured from the
     method's engine (its pools, budget, policies, prefix cache, cxl tier, high-water mark, window,
     and the cxl -> device rate the engine timed at start for its prefetcher): the same requests,
     each naming its blocks by the NodeIDs of its prompt's and answer's token ids
     (libs/kvmeta/nodeid.py, as the native prefix cache names them), so the same prefixes hit.
The clients are closed-loop: a conversation's turn is sent when its last answer is complete, a
system-prompt client's next request when its last one's is. The replay's clients are too
(the simulator's ConversationLoop, through ClosedLoop): each sends the same requests in the same
order, each at the simulated end of the one before it; the first ones at the measured run's start.
`_open_loop` instead sends every request at the time the measured run sent it: a turn the simulator
finishes later than the engine did is then still running when the next arrives, which finds less
cached and more requests in the batch.
Keys, for each method m (recompute, lru, car, car_prefetch) and workload w (multi_turn, system_prompts):
  sim_error_{p90_ttft,mean_tpot,p90_e2e}_<m>_<w>: target <= 0.15; sim_error_p50_ttft_...: no target.
Information, one assumption varied at a time: `_rescaled`, `_own_steps` (as bench sim_cacheopt's),
`_relative_fit` (the calibration's steps fitted in relative error, each step alike, as bench
sim_layerkv's: the many short decode steps weigh as much as the long prefills), `_with_f`
(the calibration fitted with the prefill-sequence term f: six terms, where the calibrated has five), `_open_loop`, and
for CaR's engines `_copy_25gbps` (the cxl tier copied at the simulator's default, a PCIe 4.0 link,
not at the rate measured here) and `_reloads_before_step` (a turn's reloads copied before its step,
not layer by layer under it, CaR III-C.1); sim_elasticity_...; and the prefix cache's hits by tier
and bytes copied, measured and simulated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import torch

from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.messages.engine import Targets
from kvmesh.services.engine.native.factory import build_engine
from kvmesh.sim.cluster import Cluster
from kvmesh.sim.conversations import ConversationLoop
from kvmesh.sim.engine import SimEngine
from kvmesh.sim.fit import recorded_shape
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

from . import car
from .cacheopt_serving import RunStats, Served
from .car_workloads import ANSWER_LEN, conversations, system_prompt_requests
from .instruction_trace import TraceRequest
from .report import BenchResult, Row
from .sim_replay import (SENSITIVITY, Configured, Variation, calibration_variants, configured, figures, keys,
                         simulated, variations)
from .sim_validation import FIGURES, TARGET, calibration_fit, plot, step_time_ratio

CALIBRATION_SEED = 11   # its conversations and system prompts (the runs': seeds 1 and 2)
WORKLOADS = ("multi_turn", "system_prompts")
PLOT = Path("bench-results/sim_car.png")
PLOTTED = ("measured", "simulated", "calibrated, rescaled to the run", "the run's own steps")
PCIE_BYTES_PER_S = 25e9  # the simulator's default copy rate (sim/engine.py's EngineSpec)


@dataclasses.dataclass(frozen=True)
class Measured:
    stats: RunStats
    requests: list[TraceRequest]
    block_names: list[tuple[str, ...]]
    clients: list[tuple[int, list[int]]]   # closed-loop clients: (how many, the requests they send in turn)
    outcome: car.Outcome


@dataclasses.dataclass
class ClosedLoop:
    """bench car's closed-loop clients over a replay's requests, for sim_replay.simulated: each of
    `clients` (how many, and the indices of the requests they send in turn) a talk of the simulator's
    ConversationLoop with no think time, its clients in process (the first requests all join the
    engine before its first step, each next one before the step after its client's last answer, as
    bench car's loop adds them before it steps)."""

    engines: Mapping[str, tuple[str, SimEngine]]
    clients: Sequence[tuple[int, list[int]]]

    def run(self, requests: Sequence[SimRequest]) -> float:
        talks = [[(requests[i], 0.0) for i in indices] for _, indices in self.clients]
        return ConversationLoop(self.engines, talks, [count for count, _ in self.clients], in_process=True).run()


def run(quick: bool) -> BenchResult:
    torch.set_num_threads(1 if quick else car.THREADS)
    n_conv, turns, n_sys = (3, 4, 24) if quick else (car.CONVERSATIONS, car.TURNS, car.REQUESTS)
    calibration = [*_served("recompute", "multi_turn", n_conv, turns, n_sys, CALIBRATION_SEED).stats.steps,
                   *_served("recompute", "system_prompts", n_conv, turns, n_sys, CALIBRATION_SEED).stats.steps]
    calibrated, fit = calibration_fit(calibration)
    runs = {(m, w): _served(m, w, n_conv, turns, n_sys) for m in car.METHODS for w in WORKLOADS}
    engines = {(m, w): configured_engine(m, w, n_conv, turns) for m in car.METHODS for w in WORKLOADS}
    others = calibration_variants(calibration)
    replays = {run: (measured, replayed(measured, engines[run], calibrated, others))
               for run, measured in runs.items()}
    return _result(quick, (n_conv, turns, n_sys), engines, calibration, calibrated, fit, replays)


def _served(method: str, workload: str, n_conv: int, turns: int, n_sys: int, seed: int | None = None) -> Measured:
    """bench car's run of `method` on `workload` (its seeds, or both workloads drawn from `seed`)."""
    settings = car.METHODS[method]
    if workload == "multi_turn":
        outcome = car.serve_multi_turn(settings, conversations(n_conv, turns, seed=seed or 1), lambda: None)
    else:
        prompts = system_prompt_requests(n_sys, car.SYSTEM_PROMPTS, car.SYSTEM_LEN, seed=seed or 2)
        outcome = car.serve_system_prompts(settings, prompts, lambda: None)
    return measured(outcome)


def measured(outcome: car.Outcome) -> Measured:
    """A run as the replay reads it: each request's arrival (seconds from the first), token times,
    prompt and answer length, its blocks' NodeIDs over its prompt and answer, and the steps timed."""
    requests = outcome.requests
    start = min(r.arrival for r in requests)
    served = [Served(r.arrival, list(r.output_times), r.preemptions) for r in requests]
    busy = max(r.output_times[-1] for r in requests) - start
    stats = RunStats(served, {}, busy, [r.arrival - start for r in requests], [Targets()] * len(requests),
                     msgspec.to_builtins(outcome.steps.read().steps))
    traced = [TraceRequest("", r.prompt_ids, len(r.output_ids)) for r in requests]
    names = [tuple(node_ids(r.prompt_ids + r.output_ids, car.BLOCK_SIZE, car.MODEL)) for r in requests]
    return Measured(stats, traced, names, clients([r.request_id for r in requests]), outcome)


def clients(request_ids: list[str]) -> list[tuple[int, list[int]]]:
    """bench car's closed-loop clients, from its requests' ids in the order sent: a conversation's
    turns (`c<i>-t<k>`) from one client each, system prompts (`s<n>`) from CLIENTS clients."""
    queues: dict[str, list[int]] = {}
    for index, request_id in enumerate(request_ids):
        queues.setdefault(request_id.split("-")[0] if request_id.startswith("c") else "s", []).append(index)
    return [(car.CLIENTS if name == "s" else 1, indices) for name, indices in queues.items()]


def configured_engine(method: str, workload: str, n_conv: int, turns: int) -> Configured:
    """The method's engine for the workload as the simulator configures it (a fresh one, its cxl
    rate timed anew at its start)."""
    tiers = car.multi_turn_tiers(conversations(n_conv, turns, seed=1)) if workload == "multi_turn" \
        else car.system_prompt_tiers()
    return configured(build_engine(car.engine_config(car.METHODS[method], *tiers)))


def replayed(run: Measured, engine: Configured, calibrated: StepCost,
             others: list[tuple[str, str, StepCost]]) -> list[Variation]:
    """bench sim_replay's variations with the run's closed-loop clients (`others`: the calibration
    fitted otherwise, sim_replay.calibration_variants); the requests sent when the measured run sent
    them; and with CaR's cxl tier its copies at PCIe's rate and a turn's reloads
    before its step."""
    loop = functools.partial(ClosedLoop, clients=run.clients)
    found = variations(run.stats, run.requests, ANSWER_LEN, engine, calibrated, others, run.block_names, loop)
    plans = [("_open_loop", "sent when measured", engine, Cluster)]
    if engine.spec.cache_cxl:
        fast = dict(swap_out_bytes_per_s=PCIE_BYTES_PER_S, swap_in_bytes_per_s=PCIE_BYTES_PER_S)
        plans += [(suffix, label, dataclasses.replace(engine, spec=dataclasses.replace(engine.spec, **change)), loop)
                  for suffix, label, change in (("_copy_25gbps", "cxl copies at 25 GB/s", fast),
                                                ("_reloads_before_step", "reloads before the step",
                                                 dict(reload_overlap=False)))]
    return found + [Variation(suffix, label, calibrated, *simulated(run.stats, run.requests, ANSWER_LEN, varied,
                                                                    calibrated, SimEngine, run.block_names, cluster))
                    for suffix, label, varied, cluster in plans]


def run_name(method: str, workload: str) -> str:
    """A run in keys: `car_prefetch_multi_turn`."""
    return f"{method.replace('+', '_')}_{workload}"


Replays = dict[tuple[str, str], tuple[Measured, list[Variation]]]


def _longest(steps: list[dict], cost: StepCost, n: int = 3) -> list[dict]:
    """The run's `n` longest steps, each with what `cost` says of its shape: a step the machine
    slowed stands out (a P90 of a few dozen requests is two or three requests' figure)."""
    return [{"seconds": s["seconds"], "calibrated_s": cost.seconds(*recorded_shape(s)),
             "prefill_tokens": s["prefill_tokens"], "decode_tokens": s["decode_tokens"]}
            for s in sorted(steps, key=lambda s: -s["seconds"])[:n]]


def _result(quick: bool, shape: tuple[int, int, int], engines: dict[tuple[str, str], Configured],
            calibration: list[dict], calibrated: StepCost, fit: dict, replays: Replays) -> BenchResult:
    rows, ratios, targets, runs = [], {}, {}, {}
    tables = {w: {label: {n: [] for n in FIGURES} for label in PLOTTED} for w in WORKLOADS}
    for (method, workload), (run, found) in replays.items():
        key = run_name(method, workload)
        for label, values in (("measured", figures(run.stats)), *((v.label, figures(v.stats)) for v in found)):
            if label in PLOTTED:
                rows.append(Row(compared=label, path=f"{method}, {workload}",
                                cells={f"{n.replace('_', ' ')} ms": values[n] * 1e3 for n in FIGURES}))
                for n in FIGURES:
                    tables[workload][label][n].append(values[n])
        run_ratios, run_targets = keys(key, run.stats, found)
        ratios |= run_ratios
        targets |= run_targets
        rows.append(Row(compared="relative error", path=f"{method}, {workload}",
                        cells={f"{n.replace('_', ' ')} ms": ratios[f"sim_error_{n}_{key}"] for n in FIGURES}))
        outcome = run.outcome
        cache = {"hit_device": outcome.hit_device, "hit_cxl": outcome.hit_cxl,
                 "reloaded_bytes": outcome.reloaded_bytes, "prefetched_nodes": outcome.prefetched}
        rows.append(Row(compared="prefix cache", path=f"{method}, {workload}", cells={
            "hit device measured": outcome.hit_device, "hit device simulated": found[0].info.get("hit_device", 0.0),
            "hit cxl measured": outcome.hit_cxl, "hit cxl simulated": found[0].info.get("hit_cxl", 0.0)}))
        runs[key] = {"requests": len(run.stats.served), "measured_steps": len(run.stats.steps),
                     "step_time_ratio_calibrated": step_time_ratio(calibrated, run.stats.steps),
                     "preemptions_measured": sum(s.preemptions for s in run.stats.served),
                     "prefix_cache_measured": cache, "longest_steps": _longest(run.stats.steps, calibrated),
                     "variations": {v.suffix or "calibrated": {"label": v.label, "preemptions": v.stats.preemptions,
                                                               "step_cost": dataclasses.asdict(v.cost), **v.info}
                                    for v in found}}
    worst = max(targets, key=lambda k: ratios[k] if not math.isnan(ratios[k]) else math.inf)
    met = sum(1 for k in targets if not math.isnan(ratios[k]) and ratios[k] <= TARGET)
    n_conv, turns, n_sys = shape
    config = {"model": car.MODEL, "dtype": car.DTYPE, "torch_threads": torch.get_num_threads(),
              "block_size": car.BLOCK_SIZE, "conversations": n_conv, "turns": turns, "system_requests": n_sys,
              "answer_len": ANSWER_LEN, "methods": {k: {**v} for k, v in car.METHODS.items()},
              "engines": {run_name(*run): {**dataclasses.asdict(c.spec), "policies": c.policies}
                          for run, c in engines.items()},
              "calibration": {"seed": CALIBRATION_SEED, "steps": len(calibration),
                              "step_cost": dataclasses.asdict(calibrated), "fit": fit},
              "sensitivity": SENSITIVITY, "runs": runs}
    plotted = plot(list(range(len(car.METHODS))), " | ".join(f"{i}: {m}" for i, m in enumerate(car.METHODS)),
                   tables, f"{car.MODEL}, bench car's runs: measured vs simulated", PLOT)
    return BenchResult(
        bench="sim_car", quick=quick, ratios=ratios, targets=targets, ceilings={},
        directions=dict.fromkeys(targets, "<="), config=config, rows=rows, plots=[plotted],
        headline=f"the simulator, calibrated on the in-process engine's steps, against bench car's runs "
                 f"({', '.join(car.METHODS)} x {', '.join(WORKLOADS)}): {met} of {len(targets)} errors within "
                 f"{TARGET:.0%}; the largest {worst} = {ratios[worst]:.2f}")
