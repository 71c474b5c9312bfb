"""A paper experiment's plot: one panel per (figure, workload), each series over the rate per engine, as
the papers draw them. Only the experiment's own points (no variation) are drawn."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .sweep import Outcome, Point  # noqa: E402


def by_rate(point: Point) -> tuple[float, str]:
    return point.rate, "rate per engine (req/s)"


def plot(outcomes: Sequence[Outcome], panels: Sequence[tuple[str, str, float]], title: str, path: Path,
         axis: Callable[[Point], tuple[float, str]] = by_rate) -> str:
    """`panels`: (figure key, axis label, scale: 1e3 for seconds shown in ms); a row each. `axis`: a
    point's x and its label (a paper's own, e.g. LayerKV's context length)."""
    own = [o for o in outcomes if not o.point.variant]
    workloads = list(dict.fromkeys(o.point.workload for o in own))
    series = list(dict.fromkeys(o.point.series for o in own))
    fig, axes = plt.subplots(len(panels), len(workloads), figsize=(5.5 * len(workloads), 3.2 * len(panels)),
                             squeeze=False)
    for row, (key, label, scale) in enumerate(panels):
        for column, workload in enumerate(workloads):
            ax = axes[row][column]
            for name in series:
                points = sorted((axis(o.point)[0], o.figures[key] * scale) for o in own if o.point.workload ==
                                workload and o.point.series == name and o.figures.get(key) is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
            ax.set_title(f"{workload}: {label}", fontsize=10)
            ax.set_xlabel(next(axis(o.point)[1] for o in own if o.point.workload == workload))
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
