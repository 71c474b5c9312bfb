"""`kvmesh sim paper NAME`: a paper's main experiment on its deployment (sim/hardware.py), its sweep
under a progress bar, its headlines beside the simulated ones, the JSON contract and the plot.

A paper is a module with: PROFILE (its deployment), TITLE, RATES and QUICK_RATES (per engine),
REQUESTS and QUICK_REQUESTS (a point), PANELS (the plot's), `points(deployment, rates, requests, seed,
quick)`, `headlines(outcomes)`, `also(outcomes)` (figures without a target) and `variations(outcomes)`
(the headlines under each varied assumption); optionally `simulate(point, cost, geometry)` (its own
simulation of a point) and `then(outcomes, deployment, rates, requests, seed, quick)` (a second stage's
points, set from the first's outcomes: CacheOpt's SLOs come from its baselines' TTFT and TBT)."""

from __future__ import annotations

import math
from pathlib import Path

from ..hardware import load_deployment
from . import cacheopt, car, contract, kvdirect, layerkv, sweep
from .plot import by_rate, plot

PAPERS = {"kvdirect": kvdirect, "cacheopt": cacheopt, "layerkv": layerkv, "car": car}


def run(name: str, quick: bool, rates: str | None, requests: int | None, seed: int, profile: str | None,
        json_path: Path | None, plot_path: Path | None) -> int:
    """Raises ValueError (an unknown paper, a bad rate list) and FileNotFoundError (no such profile)
    before anything runs."""
    if name not in PAPERS:
        raise ValueError(f"unknown paper {name!r}; papers: {', '.join(PAPERS)}")
    paper = PAPERS[name]
    chosen = parse_rates(rates) if rates is not None else paper.QUICK_RATES if quick else paper.RATES
    deployment = load_deployment(profile or paper.PROFILE)
    per_point = requests or (paper.QUICK_REQUESTS if quick else paper.REQUESTS)
    simulate = getattr(paper, "simulate", sweep.simulate)
    outcomes = sweep.run(paper.points(deployment, chosen, per_point, seed, quick), deployment.cost,
                         deployment.geometry, f"sim paper {name}", simulate)
    if hasattr(paper, "then"):
        outcomes += sweep.run(paper.then(outcomes, deployment, chosen, per_point, seed, quick), deployment.cost,
                              deployment.geometry, f"sim paper {name}", simulate)
    headlines, extra, speed = paper.headlines(outcomes), paper.also(outcomes), sweep.speed(outcomes)
    varied = {} if quick else paper.variations(outcomes)
    print(contract.table(headlines))
    print(", ".join(f"{key} {'-' if value is None else f'{value:.3g}'}" for key, value in extra.items()))
    for variation, found in varied.items():
        print(f"{variation}: " + ", ".join(f"{h.key} {h.shown(h.simulated)}" for h in found))
    print(f"{len(outcomes)} simulations: {speed['sim_seconds']:.0f} simulated s in {speed['wall_seconds']:.1f} wall s "
          f"({speed['sim_per_wall']:.0f} simulated s per wall s)")
    if plot_path is None and json_path is not None:
        plot_path = json_path.with_suffix(".png")
    plots = [plot(outcomes, paper.PANELS, paper.TITLE, plot_path, getattr(paper, "axis", by_rate))] \
        if plot_path is not None else []
    if json_path is not None:
        config = {"paper": name, "profile": deployment.name, "rates_per_engine": list(chosen),
                  "requests_per_point": per_point, "seed": seed, "speed": speed,
                  "variations": {variation: {h.key: h.simulated for h in found} for variation, found in varied.items()},
                  "about": paper.__doc__}
        contract.write(contract.result(name, quick, headlines, outcomes, config, plots, extra), json_path)
    return 0


def parse_rates(text: str) -> tuple[float, ...]:
    """`0.1,0.3,0.5`: rates per engine, each above 0; sorted, once each."""
    try:
        rates = sorted({float(part) for part in text.split(",")})
    except ValueError:
        rates = []
    if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
        raise ValueError(f"rates {text!r}: give rates per engine in req/s, comma-separated, each above 0, "
                         f"e.g. 0.1,0.3,0.5")
    return tuple(rates)
