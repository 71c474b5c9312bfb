"""`kvmesh bench tracing`: what tracing every request costs a serving cluster, and that its span file
is usable.

Two 1P1D pull clusters (bench/serve.py's `kvmesh up` on loopback, one torch thread per engine) run side
by side, identical but for the environment of the second: `KVMESH_TRACE_FILE` (every service appends its
spans to one JSON-lines file) and `KVMESH_TRACE_SAMPLE=1.0`. The same open-loop Poisson load
(bench/loadgen.py, the `arxiv` workload) goes to one and then to the other, pair of rounds after pair
of rounds, in the order off on, on off, off on, ... so that a drift of this shared 2-core machine hits
both alike; the two rounds of a pair send the same requests at the same arrival times. The rate is
moderate: half the colocated engine's saturation rate, calibrated as `kvmesh bench serve` does
(`--quick`: a fixed 8 req/s, half the 16 req/s that calibration finds on this machine).
Keys: p50_overhead = (P50 e2e on - P50 e2e off) / P50 e2e off over all rounds, target <= 0.03;
p90_overhead and mean_overhead alike; paired_overhead = the median over requests of e2e on / e2e off
- 1 (the same request of the same pair: far less noisy than the difference of two P50s);
spans_per_request = spans in the file / requests sent to the traced cluster. After the clusters stop (their exporters flush), `kvmesh report` (observability/report.py)
reads the span file: its breakdown goes in the config, its plots next to the file.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import uvloop
from rich.progress import Progress

from kvmesh.observability.report import Report, ReportError, build_report, write_outputs

from . import serve
from .loadgen import LoadResult, breakdown, run_load, served_model, summarize
from .report import BenchResult, Row
from .serve import COLOCATED, PULL, LocalCluster, Setup
from .workloads import ARXIV

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SEED = 11
SPAN_FILE = Path("bench-results/tracing/spans.jsonl")
LATENCY_PLOT = Path("bench-results/tracing_latency.png")
UNTRACED = Setup("off", "tracing off", PULL.up_args, {"KVMESH_TRACE_FILE": "", "KVMESH_OTLP_ENDPOINT": ""})  # whatever the shell says
CONCURRENCY = 64
WARM_UP_S = 3.0  # of load at the round's rate on each cluster first: the first requests of a fresh
                 # engine meet new shapes (oneDNN primitives, allocator), which is no tracing cost
TARGET = 0.03  # p50_overhead, at most


@dataclass(frozen=True)
class Plan:
    pairs: int            # pairs of rounds, one round with tracing off and one on
    window_s: float       # arrivals of one round last about this long
    drain_s: float        # then its open requests get this long to finish
    rate: float | None    # requests/s; None: half the colocated saturation rate, calibrated in the run


QUICK = Plan(pairs=2, window_s=3, drain_s=20, rate=8.0)
FULL = Plan(pairs=12, window_s=10, drain_s=30, rate=None)


def run(quick: bool) -> BenchResult:
    plan = QUICK if quick else FULL
    SPAN_FILE.parent.mkdir(parents=True, exist_ok=True)
    SPAN_FILE.unlink(missing_ok=True)  # the services append to it
    traced = Setup("on", "tracing on", PULL.up_args,
                   {"KVMESH_TRACE_FILE": str(SPAN_FILE.resolve()), "KVMESH_TRACE_SAMPLE": "1.0"})
    with (asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, Progress(transient=True) as progress,
          tempfile.TemporaryDirectory(prefix="kvmesh-bench-tracing-") as tmp):
        saturation = None if plan.rate is not None else _saturation_rate(runner, Path(tmp), progress)
        rate = plan.rate or saturation / 2
        with serve.started_together((UNTRACED, traced), Path(tmp), progress) as clusters:
            loads = runner.run(_rounds(clusters, rate, plan, progress))
    return _result(plan, quick, rate, saturation, loads)  # the clusters have stopped: every span is written


def _saturation_rate(runner: asyncio.Runner, tmp: Path, progress: Progress) -> float:
    """The rate at which one colocated engine's P50 TBT doubles: bench serve's calibration sweep."""
    with LocalCluster(COLOCATED, tmp / COLOCATED.key) as cluster:
        sweep = runner.run(serve._calibrate(cluster.url, cluster.api_key, "arxiv", serve.QUICK, progress,
                                            COLOCATED.label))
    return sweep[-1].rate


async def _rounds(clusters: dict[str, LocalCluster], rate: float, plan: Plan,
                  progress: Progress) -> dict[str, list[LoadResult]]:
    """Every round's load, per cluster key ("off", "on"), in round order."""
    models = {}
    for key, cluster in clusters.items():
        models[key] = await served_model(cluster.url, cluster.api_key)
        await run_load(cluster.url, ARXIV.requests(_warm_up_count(rate), SEED - 1), rate, model=models[key],
                       api_key=cluster.api_key, seed=SEED - 1, concurrency=CONCURRENCY, time_limit_s=60,
                       progress=progress, label=f"warming up tracing {key}")
    count = round(rate * plan.window_s)
    loads: dict[str, list[LoadResult]] = {key: [] for key in clusters}
    for pair in range(plan.pairs):
        requests = ARXIV.requests(count, SEED + pair)
        for key in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            cluster = clusters[key]
            loads[key].append(await run_load(
                cluster.url, requests, rate, model=models[key], api_key=cluster.api_key, seed=SEED + pair,
                concurrency=CONCURRENCY, time_limit_s=count / rate + plan.drain_s, progress=progress,
                label=f"tracing {key} · pair {pair + 1}/{plan.pairs} @ {rate:g} req/s"))
    return loads


def _warm_up_count(rate: float) -> int:
    return round(rate * WARM_UP_S)


# -- the result -----------------------------------------------------------------------------------

CELLS = {"ttft p50": "ttft_p50_ms", "tbt p50": "tbt_p50_ms", "e2e p50": "e2e_p50_ms", "e2e p90": "e2e_p90_ms",
         "e2e mean": "e2e_mean_ms", "req/s": "served_rps", "failed": "failed"}


def _pooled(loads: list[LoadResult]) -> LoadResult:
    return LoadResult(rate=loads[0].rate, wall_s=sum(load.wall_s for load in loads),
                      results=[r for load in loads for r in load.results], unsent=sum(load.unsent for load in loads))


def _result(plan: Plan, quick: bool, rate: float, saturation: float | None,
            loads: dict[str, list[LoadResult]]) -> BenchResult:
    off, on = summarize(_pooled(loads["off"])), summarize(_pooled(loads["on"]))
    sent_traced = _warm_up_count(rate) + sum(len(load.results) for load in loads["on"])
    report, report_note = _report()
    ratios = {f"{stat}_overhead": on[f"e2e_{stat}_ms"] / off[f"e2e_{stat}_ms"] - 1 for stat in ("p50", "p90", "mean")}
    ratios["paired_overhead"] = _paired_overhead(loads)
    ratios["spans_per_request"] = (report.spans if report else 0) / sent_traced
    path = f"1P1D pull, arxiv @ {rate:g} req/s"
    plots = [_plot(loads, rate)]
    if report and report.rows:
        plots += [SPAN_FILE.parent / "breakdown.png", SPAN_FILE.parent / "latency_cdf.png"]
    return BenchResult(
        bench="tracing", quick=quick, ratios=ratios, targets={"p50_overhead": TARGET},
        directions={"p50_overhead": "<="},
        ceilings={"untraced_e2e_p50_ms": off["e2e_p50_ms"], "untraced_e2e_p90_ms": off["e2e_p90_ms"]},
        config={**_config(plan, rate, saturation, loads), "requests_sent_traced": sent_traced,
                "report": _report_config(report, report_note),
                # admission's own breakdown (kvmesh.timings_ms), off and on: where tracing's cost lands,
                # and, on, the figures the report's should match
                "admission_breakdown_ms": {key: breakdown(_pooled(loads[key])) for key in loads}},
        rows=[Row(compared=f"tracing {key} ({plan.pairs} rounds)", path=path,
                  cells={name: figures[cell] for name, cell in CELLS.items()})
              for key, figures in (("off", off), ("on", on))],
        plots=[str(plot) for plot in plots],
        headline=f"tracing every request ({path}, {plan.pairs} rounds each): P50 end to end "
                 f"{on['e2e_p50_ms']:.1f} ms against {off['e2e_p50_ms']:.1f} ms untraced: p50_overhead = "
                 f"{ratios['p50_overhead']:+.3f} (target <= {TARGET:g}); {ratios['spans_per_request']:.1f} spans "
                 f"per request; {report_note}")


def _paired_overhead(loads: dict[str, list[LoadResult]]) -> float:
    """The median over requests of e2e on / e2e off - 1: both rounds of a pair sent request i with the
    same prompt at the same time, so its prompt length and the arrivals around it cancel out."""
    ratios = [on.e2e / off.e2e for off_load, on_load in zip(loads["off"], loads["on"])
              for off, on in zip(off_load.results, on_load.results) if off.ok and on.ok]
    return float(np.median(ratios)) - 1


def _config(plan: Plan, rate: float, saturation: float | None, loads: dict[str, list[LoadResult]]) -> dict:
    round_p50 = {key: [summarize(load)["e2e_p50_ms"] for load in loads[key]] for key in loads}
    return {
        "rate_rps": rate, "colocated_saturation_rps": saturation,
        "rate_from": "fixed (--quick)" if saturation is None else "half the colocated saturation rate",
        "pairs": plan.pairs, "order": "off on, on off, ...", "window_s": plan.window_s, "drain_s": plan.drain_s,
        "requests_per_round": round(rate * plan.window_s), "warm_up_s": WARM_UP_S, "concurrency": CONCURRENCY,
        "model": serve.MODEL, "torch_threads_per_engine": 1, "cpus": os.cpu_count(), "seed": SEED,
        "workload": serve._workload_config(ARXIV), "round_e2e_p50_ms": round_p50,
        "pair_p50_overheads": [on / off - 1 for off, on in zip(round_p50["off"], round_p50["on"])],
        "trace_env": {"KVMESH_TRACE_FILE": str(SPAN_FILE), "KVMESH_TRACE_SAMPLE": "1.0"},
    }


def _report() -> tuple[Report | None, str]:
    """`kvmesh report` on the span file (its plots and JSON beside it), and a sentence about it."""
    try:
        report = build_report(SPAN_FILE)
    except ReportError as exc:
        return None, f"no report: {exc} (do the services honour KVMESH_TRACE_FILE?)"
    write_outputs(report, SPAN_FILE.parent, SPAN_FILE.parent / "report.json")
    return report, (f"kvmesh report {SPAN_FILE}: {len(report.rows)} requests broken down, "
                    f"{len(report.incomplete)} incomplete traces, {len(report.skipped_lines)} unreadable lines")


def _report_config(report: Report | None, note: str) -> dict:
    if report is None:
        return {"note": note}
    return {"note": note, "spans": report.spans, "traces": len(report.traces), "requests": len(report.rows),
            "incomplete": len(report.incomplete), "skipped_lines": len(report.skipped_lines),
            "incomplete_reasons": dict(Counter(i.reason for i in report.incomplete).most_common(5)),
            "mean_breakdown_ms": {mode: {metric: stats["mean"] for metric, stats in metrics.items()}
                                  for mode, metrics in report.aggregates.items()}}


def _plot(loads: dict[str, list[LoadResult]], rate: float) -> Path:
    """The end-to-end CDF with tracing off and on, and each round's P50 (drift shows there)."""
    fig, (cdf, rounds) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("off", "tracing off"), ("on", "tracing on")):
        cdf.ecdf([r.e2e * 1e3 for r in _pooled(loads[key]).results if r.ok], label=label)
        p50 = [summarize(load)["e2e_p50_ms"] for load in loads[key]]
        rounds.plot(np.arange(1, len(p50) + 1), p50, marker="o", label=label)
    cdf.set_xlabel("end-to-end latency (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title(f"end to end, 1P1D pull @ {rate:g} req/s")
    rounds.set_xlabel("pair of rounds")
    rounds.set_ylabel("P50 end to end (ms)")
    rounds.set_title("each round's P50")
    for ax in (cdf, rounds):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    LATENCY_PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(LATENCY_PLOT, dpi=120)
    plt.close(fig)
    return LATENCY_PLOT
