"""The benchmark contract (ARCHITECTURE.md, Benchmarks): one result shape, printed and saved alike."""

from __future__ import annotations

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


class BenchResult(msgspec.Struct, kw_only=True):
    bench: str
    quick: bool
    ratios: dict[str, float]
    targets: dict[str, float]
    meets: dict[str, bool]
    ceilings: dict[str, float]
    config: dict[str, Any]
    rows: list[Row]
    headline: str
    plots: list[str] = []


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
        verdict = "" if target is None else f"  (target {target:g}: {'meets' if result.meets[key] else 'MISSES'})"
        console.print(f"{key} = {value:.3f}{verdict}")
    for plot in result.plots:
        console.print(f"plot: {plot}")
    console.print(result.headline)


def _figure(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3f}"


def save(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result)))
