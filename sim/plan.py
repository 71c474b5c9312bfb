"""`kvmesh plan`: for a workload and its SLOs, the configuration with the highest SLO goodput per
engine, searched in the simulator over topologies (colocated:N, pd:P:D), engine counts and policies
(routing, pull or push, preemption order); the runner-up, which SLO binds it and at what rate; and
how many replicas of the pick serve the rate asked.

Goodput is DistServe's (OSDI'24): the highest arrival rate at which at least X% of requests meet every
SLO, found for each configuration by bisection on one workload (sim/plan_search.py); per engine, it is
divided by the configuration's engine count."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from .engine import EngineSpec
from .plan_search import Candidate, Goodput, Run, Simulator, bisect_goodput, parse_counts, parse_slos, search_space
from .step_cost import load_profile
from .workload import Lengths


@dataclass(frozen=True, slots=True)
class Result:
    candidate: Candidate
    goodput: Goodput

    @property
    def per_engine(self) -> float:
        return self.goodput.rate / self.candidate.engines


def run(profile: str, rate: float, prompt: str, output: str, slos: list[str], attainment: float, spec: EngineSpec,
        engines: str, kinds: list[str], routings: list[str], transfer_modes: list[str],
        preemption_orders: list[str], requests: int, seed: int, tolerance: float, json_path: Path | None,
        plot_path: Path | None) -> int:
    """`attainment`: the percentage of requests that must meet every SLO. Bad input: a message on
    stderr, exit status 2, nothing run or written."""
    try:
        if rate <= 0 or not 0 < attainment <= 100 or not 0 < tolerance < 1 or requests < 1:
            raise ValueError(f"rate must be above 0 (got {rate}), attainment in (0, 100] (got {attainment}), "
                             f"tolerance in (0, 1) (got {tolerance}), requests at least 1 (got {requests})")
        simulator = Simulator(Lengths.parse(prompt), Lengths.parse(output), requests, seed, parse_slos(slos), spec,
                              load_profile(profile))
        counts = parse_counts(engines)
        space = search_space(counts, kinds, routings, transfer_modes, preemption_orders)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        print(f"kvmesh plan: {exc.args[0] if exc.args else exc}", file=sys.stderr)  # a KeyError's str quotes it
        return 2
    target = attainment / 100
    results = _search(space, simulator, rate, target, tolerance)
    ranked = sorted(results, key=lambda r: -r.per_engine)  # stable: a tie goes to the one listed first
    pick = _pick(ranked, simulator, rate, target)
    print(_table(ranked, simulator))
    print("\n".join(pick["lines"]))
    config = {"profile": profile, "rate_rps": rate, "prompt": prompt, "output": output,
              "slos_ms": {name: limit * 1e3 for name, limit in simulator.slos.items()}, "attainment": target,
              "engine": asdict(spec), "search": {"engines": counts, "topologies": kinds, "routing": routings,
                         "transfer_modes": transfer_modes, "preemption_orders": preemption_orders},
              "requests": requests, "seed": seed, "tolerance": tolerance, "link": asdict(simulator.link),
              "kv_geometry": asdict(simulator.geometry), "simulations": simulator.simulated, "shared": simulator.shared}
    if json_path is not None:
        body = {"plan": "goodput", "config": config, "results": [_result(r, simulator) for r in ranked],
                "pick": {key: value for key, value in pick.items() if key != "lines"}}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(body, indent=2) + "\n")
    if plot_path is not None:
        from .plan_plot import plot  # matplotlib only when a plot is asked for
        plot(ranked, target, plot_path)
    return 0


def _search(space: list[Candidate], simulator: Simulator, rate: float, target: float,
            tolerance: float) -> list[Result]:
    results = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("configurations", total=len(space))
        for candidate in space:
            def attained(at: float, candidate: Candidate = candidate) -> float:
                progress.update(task, description=f"{candidate} @ {at:.3g} req/s")
                return simulator.run(candidate, at).attainment["all"]

            results.append(Result(candidate, bisect_goodput(attained, target, rate, tolerance)))
            progress.advance(task)
    return results


def _pick(ranked: list[Result], simulator: Simulator, rate: float, target: float) -> dict:
    """The winner, the configurations tied with it, the runner-up (the best with a lower goodput per
    engine), which SLO binds the runner-up at the first rate it misses and how the winner does there,
    and the replicas of the winner the rate asked needs."""
    winner = ranked[0]
    ties = [r for r in ranked[1:] if r.per_engine == winner.per_engine]
    runner = next((r for r in ranked if r.per_engine < winner.per_engine), None)
    lines = [f"pick: {winner.candidate}: goodput {_rate(winner.goodput)}, {winner.per_engine:.2f} req/s per engine"
             f"{_limit(winner, simulator)}"]
    if ties:
        lines.append(f"tied with it: {'; '.join(str(r.candidate) for r in ties)}")
    why = None
    if runner is None:
        lines.append("runner-up: none (every configuration reached the same goodput per engine)")
    else:
        lines.append(f"runner-up: {runner.candidate}: goodput {_rate(runner.goodput)}, {runner.per_engine:.2f} req/s "
                     f"per engine{_limit(runner, simulator)}")
        if runner.goodput.failed_at is not None:
            at = runner.goodput.failed_at
            missed, held = simulator.run(runner.candidate, at), simulator.run(winner.candidate, at)
            binding = _binding(missed, simulator.slos)
            why = {"rate_rps": at, "binding_slo": binding, "runner_up": _run(missed), "pick": _run(held)}
            lines.append(f"why: at {at:.2f} req/s the runner-up meets every SLO for {missed.attainment['all']:.1%} "
                         f"of requests (target {target:.0%}); {binding} binds it ({_attained(missed, simulator.slos)});"
                         f" the pick meets every SLO there for {held.attainment['all']:.1%}")
    replicas = math.ceil(rate / winner.goodput.rate - 1e-9) if winner.goodput.rate > 0 else None
    lines.append(f"replicas: {replicas} of the pick ({replicas * winner.candidate.engines} engines) serve {rate:g} "
                 f"req/s, {rate / replicas:.2f} each" if replicas else
                 f"replicas: none serve {rate:g} req/s: the pick met the SLOs at no rate tried")
    return {"winner": _candidate(winner.candidate), "goodput_rps": winner.goodput.rate,
            "goodput_per_engine_rps": winner.per_engine, "ties": [str(r.candidate) for r in ties],
            "runner_up": None if runner is None else _candidate(runner.candidate),
            "runner_up_goodput_per_engine_rps": None if runner is None else runner.per_engine, "why": why,
            "replicas": replicas, "engines_total": replicas and replicas * winner.candidate.engines, "lines": lines}


def _binding(run: Run, slos: dict[str, float]) -> str:
    """The SLO the fewest requests meet."""
    return min(slos, key=lambda name: run.attainment[name])


def _attained(run: Run, slos: dict[str, float]) -> str:
    return ", ".join(f"{name} <= {limit * 1e3:g} ms: {run.attainment[name]:.1%}" for name, limit in slos.items())


def _limit(result: Result, simulator: Simulator) -> str:
    """What binds a configuration at the first rate it misses."""
    at = result.goodput.failed_at
    if at is None:
        return ""
    missed = simulator.run(result.candidate, at)
    return f" (at {at:.2f} req/s {_binding(missed, simulator.slos)} binds: {_attained(missed, simulator.slos)})"


def _rate(goodput: Goodput) -> str:
    return f"{'at least ' if goodput.failed_at is None else ''}{goodput.rate:.2f} req/s"


def _table(ranked: list[Result], simulator: Simulator) -> str:
    header = ("configuration", "engines", "goodput req/s", "per engine", "first rate missed", "binding SLO")
    rows = [header]
    for r in ranked:
        at = r.goodput.failed_at
        rows.append((str(r.candidate), str(r.candidate.engines), _rate(r.goodput).removesuffix(" req/s"),
                     f"{r.per_engine:.2f}", "-" if at is None else f"{at:.2f}",
                     "-" if at is None else _binding(simulator.run(r.candidate, at), simulator.slos)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))) for row in rows)


def _candidate(candidate: Candidate) -> dict:
    return {"configuration": str(candidate), "topology": str(candidate.topology), "engines": candidate.engines,
            "routing": candidate.routing, "transfer_mode": candidate.transfer_mode,
            "preemption_order": candidate.preemption_order}


def _run(run: Run) -> dict:
    return {"attainment": run.attainment, "ttft_p90_s": run.ttft_p90_s, "tpot_mean_s": run.tpot_mean_s,
            "e2e_p90_s": run.e2e_p90_s, "preemptions": run.preemptions, "unfinished": run.unfinished}


def _result(result: Result, simulator: Simulator) -> dict:
    return {**_candidate(result.candidate), "goodput_rps": result.goodput.rate,
            "goodput_per_engine_rps": result.per_engine, "failed_at_rps": result.goodput.failed_at,
            "probes": [{"rate_rps": at, **_run(simulator.run(result.candidate, at))}
                       for at, _ in result.goodput.probes]}
