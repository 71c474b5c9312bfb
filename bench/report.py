"""The benchmark contract (ARCHITECTURE.md, Benchmarks): one result shape, printed and saved alike."""

from __future__ import annotations

import functools
import math
import operator
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table


class Row(msgspec.Struct, kw_only=True):
    """One line of the comparison table: what was compared, over which path, and its figures."""

    compared: str
    path: str
    cells: dict[str, float]


# How a key's ratio is held against its target. A target is a floor (">=") unless its bench says otherwise.
DIRECTIONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def judge(ratios: Mapping[str, float], targets: Mapping[str, float], directions: Mapping[str, str]) -> dict[str, bool]:
    """Whether each target is met: its ratio compared with it in its direction. A ratio that is missing
    or NaN (its measurement failed) misses: a target is never dropped."""
    met = {}
    for key, target in targets.items():
        value = ratios.get(key, math.nan)
        met[key] = bool(not math.isnan(value) and DIRECTIONS[directions.get(key, ">=")](value, target))
    return met


# The CPU features the engine's kernels and oneDNN's bf16 matmuls choose between: with AMX tiles bf16
# prefill ran 1.5-2.3x faster than on AVX512-BF16 alone (docs/benchmarks.md, "engine").
INSTRUCTIONS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@functools.cache
def machine() -> dict[str, Any]:
    """The CPU a result was measured on: its model, the cores this process may use, and which of
    INSTRUCTIONS it has (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "model name":
                    model = value.strip()
                elif name.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"cpu": model, "cores": cores, "instructions": [i for i in INSTRUCTIONS if i in flags]}


class BenchResult(msgspec.Struct, kw_only=True):
    """What a benchmark measured. `meets` is derived here, from ratios, targets and directions, so no
    bench judges its own keys: every target gets a direction (">=" unless given) and a ratio (NaN when
    its measurement is missing, which misses)."""

    bench: str
    quick: bool
    ratios: dict[str, float]
    targets: dict[str, float]
    ceilings: dict[str, float]
    config: dict[str, Any]
    rows: list[Row]
    headline: str
    directions: dict[str, str] = {}
    meets: dict[str, bool] = {}
    plots: list[str] = []
    machine: dict[str, Any] = msgspec.field(default_factory=machine)  # sessions run on different CPUs

    def __post_init__(self) -> None:
        unknown = {k: d for k, d in self.directions.items() if k not in self.targets or d not in DIRECTIONS}
        if unknown:
            raise ValueError(f"directions for no target, or not one of {', '.join(DIRECTIONS)}: {unknown}")
        self.directions = {key: self.directions.get(key, ">=") for key in self.targets}
        self.ratios = {**self.ratios, **{key: math.nan for key in self.targets if key not in self.ratios}}
        self.meets = judge(self.ratios, self.targets, self.directions)


def percentile(values: Iterable[float], q: float) -> float:
    """numpy's linear percentile, with infinite values (failed requests) allowed at the top: the
    contract's every-request figures count a failure as missing any SLO. No values: infinite."""
    ordered = sorted(values)
    if not ordered:
        return math.inf
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    if math.isinf(ordered[high]):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def save_figure(fig, path: Path, dpi: int = 110) -> str:
    """Write a matplotlib figure (making its folder) and close it; the path, for BenchResult.plots."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return str(path)


def latency_row(compared: str, path: str, seconds: list[float], wall_s: float) -> Row:
    ms = np.asarray(seconds) * 1e3
    return Row(compared=compared, path=path, cells={"p50 ms": float(np.percentile(ms, 50)),
                                                    "p99 ms": float(np.percentile(ms, 99)),
                                                    "ops/s": len(seconds) / wall_s})


def show(result: BenchResult) -> None:
    console = Console(highlight=False)
    table = Table(title=f"kvmesh bench {result.bench}{' (quick)' if result.quick else ''}")
    columns = list(dict.fromkeys(key for row in result.rows for key in row.cells))
    table.add_column("compared")
    table.add_column("path")
    for column in columns:
        table.add_column(column, justify="right")
    for row in result.rows:
        table.add_row(row.compared, row.path, *(_figure(row.cells.get(c)) for c in columns))
    console.print(table)
    for key, value in result.ratios.items():
        target = result.targets.get(key)
        verdict = "" if target is None else \
            f"  (target {result.directions[key]} {target:g}: {'meets' if result.meets[key] else 'MISSES'})"
        console.print(f"{key} = {value:.3f}{verdict}")
    for plot in result.plots:
        console.print(f"plot: {plot}")
    console.print(f"machine: {result.machine['cpu']}, {result.machine['cores']} cores, "
                  f"{' '.join(result.machine['instructions']) or 'no AVX-512'}")
    console.print(result.headline)


def _figure(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3f}"


def save(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result)))
