"""`kvmesh plan --plot`: each configuration's attainment over the rates its bisection ran, and its
goodput per engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from .plan import Result


def plot(ranked: Sequence[tuple[str, Result]], target: float, path: Path, unit: str = "req/s") -> None:
    """`ranked`: (label, result), best first; the pick drawn bold; `unit`: what a rate counts."""
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(14, 1.5 + max(4.0, 0.3 * len(ranked))))
    colours = plt.get_cmap("tab20").colors
    for index, (label, result) in enumerate(ranked):
        probes = sorted(result.goodput.probes)
        curves.plot([rate for rate, _ in probes], [100 * attained for _, attained in probes], marker="o",
                    markersize=3, linewidth=2.5 if index == 0 else 1, color=colours[index % len(colours)], label=label)
    curves.axhline(100 * target, linestyle="--", color="grey", label=f"target {target:.0%}")
    curves.set_xlabel(f"arrival rate ({unit})")
    curves.set_ylabel("requests meeting every SLO (%)")
    curves.set_title("SLO attainment over rate (the rates each bisection ran)")
    curves.legend(fontsize=7)
    bars.barh([label for label, _ in ranked], [r.per_engine for _, r in ranked],
              color=["tab:green"] + ["tab:blue"] * (len(ranked) - 1))
    bars.invert_yaxis()
    bars.tick_params(axis="y", labelsize=7)
    bars.set_xlabel(f"goodput per engine ({unit})")
    bars.set_title("goodput per engine (the pick in green)")
    for ax in (curves, bars):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
