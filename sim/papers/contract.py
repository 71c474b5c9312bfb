"""A paper experiment's result in the benchmarks' JSON contract (ARCHITECTURE.md, Benchmarks; the keys
of bench/report.py's BenchResult, which sim does not import: sim depends on policies and libs only).

Each of the paper's headlines is a ratio `sim_<key>` (the simulated value) and a key `<key>_factor`
with the issue's target: the simulated value is on the published one's side (a reduction above 0, a
ratio above 1) and within a factor of 1.5 of it, `max(sim / paper, paper / sim) <= 1.5`; on the
wrong side the factor is NaN (null in the JSON), which misses."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .sweep import Outcome

FACTOR = 1.5  # issue 31: each headline within a factor of 1.5 of its published size
UNITS = ("%", "x")  # a fraction of the baseline (0.55: 55% less), or a ratio (2.2: 2.2 times)


@dataclass(frozen=True, slots=True)
class Headline:
    key: str
    claim: str              # the paper's statement, with its figure or section
    published: float
    simulated: float | None
    unit: str               # "%": the side is above 0; "x": above 1

    @property
    def factor(self) -> float:
        """How far the simulated value is from the published one, as a factor; NaN on the wrong side."""
        side = 0.0 if self.unit == "%" else 1.0
        if self.simulated is None or self.simulated <= side or self.published <= side:
            return math.nan
        return max(self.simulated / self.published, self.published / self.simulated)

    def shown(self, value: float | None) -> str:
        if value is None or math.isnan(value):
            return "-"
        return f"{value:.1%}" if self.unit == "%" else f"{value:.2f}x"


def result(name: str, quick: bool, headlines: Sequence[Headline], outcomes: Sequence[Outcome], config: dict,
           plots: Sequence[str], also: Mapping[str, float | None] | None = None) -> dict:
    """The contract's body: ratios (each headline's simulated value and factor, and `also`: figures
    without a target), targets, directions, meets, ceilings (none), config, rows (one a simulated
    point), headline, plots."""
    ratios = {f"sim_{h.key}": math.nan if h.simulated is None else h.simulated for h in headlines} | \
        {f"{h.key}_factor": h.factor for h in headlines} | \
        {key: math.nan if value is None else value for key, value in (also or {}).items()}
    targets = {f"{h.key}_factor": FACTOR for h in headlines}
    meets = {key: not math.isnan(ratios[key]) and ratios[key] <= FACTOR for key in targets}
    met = sum(meets.values())
    return {"bench": f"sim paper {name}", "quick": quick, "ratios": ratios, "targets": targets,
            "directions": dict.fromkeys(targets, "<="), "meets": meets, "ceilings": {},
            "config": config | {"published": {h.key: {"claim": h.claim, "value": h.published, "unit": h.unit}
                                              for h in headlines}},
            "rows": [row(o) for o in outcomes],
            "headline": f"{name}: {met} of {len(targets)} headlines within a factor of {FACTOR} of the paper's",
            "plots": list(plots)}


def row(outcome: Outcome) -> dict:
    point, figures = outcome.point, outcome.figures
    cells = {"rate per engine": point.rate, "p90 e2e s": figures["e2e_p90_s"], "mean e2e s": figures["e2e_mean_s"],
             "p90 ttft s": figures["ttft_p90_s"], "mean ttft s": figures["ttft_mean_s"],
             "p99 ttft s": figures.get("ttft_p99_s"), "p90 tbt ms": _ms(figures["tbt_p90_s"]),
             "p99 tbt ms": _ms(figures.get("tbt_p99_s")), "p99 longest gap ms": _ms(figures.get("tbt_max_p99_s")),
             "normalised latency ms": _ms(figures.get("normalised_latency_s")),
             "preemptions": figures.get("preemptions"),
             "tpot mean ms": _ms(figures["tpot_mean_s"]), "slo violations": figures.get("slo_violation"),
             "tokens per s": figures["throughput_tok_s"],
             "transfer share": figures["transfer_share"], "unfinished": figures["unfinished"],
             "sim per wall": figures["sim_per_wall"]}
    variant = f" ({point.variant})" if point.variant else ""
    return {"compared": f"{point.workload} {point.series}{variant}",
            "path": f"{point.topology} {point.transfer_mode} @ {point.rate * point.engines:g} req/s, "
                    f"prompts {point.prompt}, outputs {point.output}",
            "cells": {key: math.nan if value is None else float(value) for key, value in cells.items()}}


def table(headlines: Sequence[Headline]) -> str:
    """The paper's headlines beside the simulated ones, as printed."""
    lines = [("headline", "paper", "simulated", "factor")] + \
        [(h.claim, h.shown(h.published), h.shown(h.simulated),
          "wrong side" if math.isnan(h.factor) else f"{h.factor:.2f}") for h in headlines]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join(f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}" for a, b, c, d in lines)


def write(body: dict, path: Path) -> None:
    """As JSON, NaN written null as bench's msgspec writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_nulls(body), indent=2) + "\n")


def _nulls(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _nulls(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_nulls(item) for item in value]
    return value


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
