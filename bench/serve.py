"""`kvmesh bench serve`: end-to-end serving latency of a real local cluster, KVDirect section 5.2.

Each configuration is its own `kvmesh up` (a subprocess on free ports, every engine one torch thread,
the `tiny` preset: the rates below are calibrated on it; `kvmesh bench peer` serves the real model):
  (1) 1P1D pull: one prefill and one decode engine, the decode engine pulls the KV (KVDirect);
  (2) 1P1D push: the same, the prefill engine writes the KV (`KVMESH_ADMISSION_TRANSFER_MODE=push`);
  (3) one colocated engine at half the request rate: KVDirect's fair comparison (section 5.2.1, "the
      actual QPS of vLLM is divided by 2"), each engine one core;
  (4) two colocated engines behind the same admission (data parallel), at (1)'s rate: the same two
      cores as 1P1D at the same load, the comparison a user deciding between the two would make.
The rate is calibrated in the same run: a sweep on (3) from a light load upwards stops at the first
rate whose P50 TBT is at least twice the lightly loaded one (KVDirect saw vLLM's TBT grow up to
2.2x); that run is (3)'s measurement, and (1), (2) and (4) run at twice that rate. Workloads (workloads.py):
`arxiv` (long prompt, short answer) and, in the full run, `sharegpt` (its keys end in `_sharegpt`).
Keys: p90_latency_reduction_vs_colocated = 1 - P90 e2e (1) / P90 e2e (3), target >= 0.4, over every
request sent (a failed or timed-out one sits at the top of the distribution; each row also gives the
P90s of the completed requests and counts the failures): KVDirect's framing, (3) at half the load;
p90_latency_reduction_vs_data_parallel, the same against (4): the equal-hardware framing, information
(no target: the paper states none for it);
mean_latency_reduction_pull_vs_push = 1 - mean e2e (1) / mean e2e (2), target >= 0.2 (full run only);
transfer_share = mean transfer / mean e2e of (1) from the admission's `kvmesh.timings_ms`, target
<= 0.02; colocated_tbt_growth, how far (3)'s P50 TBT grew at its rate. `--quick` runs (3), (1) and (4)
on `arxiv` only, with shorter windows and loads of at least 8 requests, not 16.
With `--target URL` the same workloads and rate sweep drive any OpenAI-compatible server instead
(API key from OPENAI_API_KEY), reporting the same percentiles; a server without kvmesh's per-request
breakdown gets no breakdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import uvloop
from rich.progress import Progress

from kvmesh.infra.local.processes import free_port

from .loadgen import STAGES, LoadResult, breakdown, run_load, served_model, summarize
from .report import BenchResult, Row
from .workloads import WORKLOADS, Workload

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SEED = 7
# 0: the launcher binds each a port at once (kvmesh status says which); a port picked here and bound
# later can be taken meanwhile. Engines bind their own, from a free base port up.
SERVICES = ("kvmeta", "scheduler", "predictor", "admission")
START_TIMEOUT_S = 240.0
BREAKDOWN_PLOT = Path("bench-results/serve_breakdown.png")
LATENCY_PLOT = Path("bench-results/serve_latency.png")


@dataclass(frozen=True)
class Setup:
    """One cluster configuration: how `kvmesh up` is started for it."""

    key: str
    label: str
    up_args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


PULL = Setup("pull", "(1) 1P1D pull", ("--prefill", "1", "--decode", "1"))
PUSH = Setup("push", "(2) 1P1D push", ("--prefill", "1", "--decode", "1"), {"KVMESH_ADMISSION_TRANSFER_MODE": "push"})
COLOCATED = Setup("colocated", "(3) colocated", ("--colocated",))  # at half the rate
# The equal-hardware framing: two colocated engines (a core each) behind the same admission, at 1P1D's rate.
DATA_PARALLEL = Setup("dp", "(4) 2 colocated, data parallel", ("--colocated", "2"))


@dataclass(frozen=True)
class Plan:
    """What one run measures: the workloads, the setups, and how long each load lasts."""

    workloads: tuple[str, ...]
    setups: tuple[Setup, ...]        # after (3), which the rate is calibrated on
    window_s: float                  # arrivals of one load last about this long
    drain_s: float                   # then its open requests get this long to finish
    min_requests: int                # per load, so the light load's TBT is a median of enough requests


QUICK = Plan(workloads=("arxiv",), setups=(PULL, DATA_PARALLEL), window_s=8, drain_s=30, min_requests=8)
FULL = Plan(workloads=("arxiv", "sharegpt"), setups=(PULL, PUSH, DATA_PARALLEL), window_s=20, drain_s=60,
            min_requests=16)
# Rates (requests/s) tried on (3), the first lightly loaded: one engine on one core serves about 16
# arxiv or 12 sharegpt requests/s before its queue grows without bound (measured on this machine).
SWEEP = {"arxiv": (1, 4, 8, 12, 16, 20, 24, 32), "sharegpt": (1, 2, 4, 6, 8, 12, 16, 24)}
CONCURRENCY = 64                     # open requests at most (admission's default max_running)
# The engines' model: the `tiny` preset, which the rates above were calibrated on. The real default
# model serves about a hundredth of these rates on this machine; its serving comparison, with stock
# vLLM, is `kvmesh bench peer`.
MODEL = "tiny"


class LocalCluster:
    """`python -m kvmesh up` in a run directory of its own, on free ports, stopped with SIGTERM."""

    def __init__(self, setup: Setup, run_dir: Path):
        self.setup, self.run_dir = setup, run_dir
        self.log = run_dir / "up.log"
        self.process: subprocess.Popen | None = None
        self.url, self.api_key = "", ""

    def __enter__(self) -> LocalCluster:
        env = {**os.environ, **{f"KVMESH_{s.upper()}_PORT": "0" for s in SERVICES},
               "KVMESH_ENGINE_PORT": str(free_port()),
               "KVMESH_ENGINE_TORCH_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING", "KVMESH_ENGINE_MODEL": MODEL,
               "KVMESH_ADMISSION_REQUESTS_PER_S": "100000", "KVMESH_ADMISSION_BURST": "100000", **self.setup.env}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvmesh", "up", "--run-dir", str(self.run_dir), "--exit-with-parent",
                 *self.setup.up_args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvmesh up ({self.setup.label}) exited with {self.process.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            done = subprocess.run([sys.executable, "-m", "kvmesh", "status", "--run-dir", str(self.run_dir), "--json"],
                                  capture_output=True, text=True)
            status = json.loads(done.stdout or "{}")
            children = status.get("children", [])
            admission = next((c for c in children if c["name"] == "admission"), None)
            if status.get("running") and admission and all(c["ready"] for c in children):
                self.url, self.api_key = admission["url"], (self.run_dir / "api_key").read_text().strip()
                return
            time.sleep(1.0)
        raise RuntimeError(f"kvmesh up ({self.setup.label}) was not ready within {START_TIMEOUT_S:.0f}s; see {self.log}")

    def __exit__(self, *_: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def run(quick: bool, target: str | None = None) -> BenchResult:
    plan = QUICK if quick else FULL
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, Progress(transient=True) as progress:
        if target is not None:
            api_key = os.environ.get("OPENAI_API_KEY")
            sweeps = {w: runner.run(_calibrate(target, api_key, w, plan, progress, "target")) for w in plan.workloads}
            return _target_result(target, plan, quick, sweeps)
        sweeps, measured = {}, {}
        # Every cluster starts up front and waits idle for its turn: one start-up on the clock, not one per setup.
        with (tempfile.TemporaryDirectory(prefix="kvmesh-bench-serve-") as tmp,
              started_together((COLOCATED, *plan.setups), Path(tmp), progress) as clusters):
            colocated = clusters[COLOCATED.key]
            for w in plan.workloads:
                sweeps[w] = runner.run(_calibrate(colocated.url, colocated.api_key, w, plan, progress,
                                                  COLOCATED.label))
                measured[(COLOCATED.key, w)] = sweeps[w][-1]
            for setup in plan.setups:
                cluster = clusters[setup.key]
                for w in plan.workloads:
                    measured[(setup.key, w)] = runner.run(measured_load(
                        cluster.url, cluster.api_key, w, 2 * sweeps[w][-1].rate, plan, progress, setup.label))
    return _result(plan, quick, sweeps, measured)


@contextlib.contextmanager
def started_together(setups: tuple[Setup, ...], tmp: Path, progress: Progress) -> Iterator[dict[str, LocalCluster]]:
    """The clusters, started in parallel (each start mostly waits on its children), stopped at the end."""
    task = progress.add_task(f"starting {' and '.join(s.label for s in setups)}", total=None)
    clusters = {s.key: LocalCluster(s, tmp / s.key) for s in setups}
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(len(clusters)) as pool:
            starts = {key: pool.submit(cluster.__enter__) for key, cluster in clusters.items()}
        for key, start in starts.items():
            if start.exception() is None:
                stack.callback(clusters[key].__exit__)
        failed = [start.exception() for start in starts.values() if start.exception() is not None]
        if failed:
            raise failed[0]
        progress.remove_task(task)
        yield clusters


async def measured_load(url: str, api_key: str | None, workload: str, rate: float, plan: Plan,
                        progress: Progress, label: str, seed: int = SEED,
                        warmed: Callable[[], object] | None = None) -> LoadResult:
    """One Poisson load of `workload` at `rate` (its requests and arrivals of `seed`), after a few
    unmeasured warm-up requests (of seed + 1; `warmed()` is called after them)."""
    spec = WORKLOADS[workload]
    model = await served_model(url, api_key)
    await run_load(url, spec.requests(4, seed + 1), 100.0, model=model, api_key=api_key, time_limit_s=60)
    if warmed is not None:
        warmed()
    count = max(plan.min_requests, round(rate * plan.window_s))
    return await run_load(url, spec.requests(count, seed), rate, model=model, api_key=api_key, seed=seed,
                          concurrency=CONCURRENCY, time_limit_s=count / rate + plan.drain_s,
                          progress=progress, label=f"{label} · {workload} @ {rate:g} req/s")


async def _calibrate(url: str, api_key: str | None, workload: str, plan: Plan, progress: Progress,
                     label: str) -> list[LoadResult]:
    """The sweep up to (and including) the first rate whose P50 TBT is twice the light load's."""
    sweep: list[LoadResult] = []
    for rate in SWEEP[workload]:
        sweep.append(await measured_load(url, api_key, workload, rate, plan, progress, label))
        if _tbt(sweep[-1]) >= 2 * _tbt(sweep[0]):
            break
    return sweep


def _tbt(load: LoadResult) -> float:
    return summarize(load)["tbt_p50_ms"]


# -- the result -----------------------------------------------------------------------------------

# table columns: milliseconds (completed requests; "every": every request sent, a failure at the top),
# then requests served per second and requests that failed
CELLS = {"ttft p50": "ttft_p50_ms", "ttft p90": "ttft_p90_ms", "ttft p90 every": "ttft_p90_every_ms",
         "tbt p50": "tbt_p50_ms", "tbt p90": "tbt_p90_ms", "e2e p50": "e2e_p50_ms", "e2e p90": "e2e_p90_ms",
         "e2e p90 every": "e2e_p90_every_ms", "e2e mean": "e2e_mean_ms", "req/s": "served_rps", "failed": "failed"}
TARGETS = {"p90_latency_reduction_vs_colocated": 0.4, "mean_latency_reduction_pull_vs_push": 0.2, "transfer_share": 0.02}
AT_MOST = {"transfer_share"}  # the other targets are floors


def _row(compared: str, workload: str, load: LoadResult, note: str = "") -> Row:
    figures = summarize(load)
    return Row(compared=compared, path=f"{workload} @ {load.rate:g} req/s{note}",
               cells={name: figures[key] for name, key in CELLS.items()})


def _result(plan: Plan, quick: bool, sweeps: dict[str, list[LoadResult]],
            measured: dict[tuple[str, str], LoadResult]) -> BenchResult:
    """Rows, the issue's keys (on arxiv; sharegpt's carry a suffix), the breakdown and the plots."""
    setups = (COLOCATED, *plan.setups)
    rows, ratios, ceilings, breakdowns = [], {}, {}, {}
    for w in plan.workloads:
        rows += [_row(COLOCATED.label, w, load, ", sweep") for load in sweeps[w][:-1]]
        rows += [_row(s.label, w, measured[(s.key, w)]) for s in setups]
        suffix = "" if w == "arxiv" else f"_{w}"
        figures = {s.key: summarize(measured[(s.key, w)]) for s in setups}
        light = summarize(sweeps[w][0])
        ratios[f"p90_latency_reduction_vs_colocated{suffix}"] = \
            1 - figures["pull"]["e2e_p90_every_ms"] / figures["colocated"]["e2e_p90_every_ms"]
        ratios[f"p90_latency_reduction_vs_data_parallel{suffix}"] = \
            1 - figures["pull"]["e2e_p90_every_ms"] / figures["dp"]["e2e_p90_every_ms"]
        if "push" in figures:
            ratios[f"mean_latency_reduction_pull_vs_push{suffix}"] = \
                1 - figures["pull"]["e2e_mean_ms"] / figures["push"]["e2e_mean_ms"]
        share = _transfer_share(measured[("pull", w)])
        if share is not None:
            ratios[f"transfer_share{suffix}"] = share
        ratios[f"colocated_tbt_growth{suffix}"] = figures["colocated"]["tbt_p50_ms"] / light["tbt_p50_ms"]
        for key in ("ttft_p50_ms", "tbt_p50_ms", "e2e_p50_ms"):
            ceilings[f"light_{key}{suffix}"] = light[key]
        for s in setups:
            stages = breakdown(measured[(s.key, w)])
            if stages is not None:
                breakdowns[f"{s.label} / {w}"] = stages
    plots = [_plot_latency(plan, sweeps, {(s.label, w): measured[(s.key, w)] for s in setups for w in plan.workloads})]
    if breakdowns:
        plots.append(_plot_breakdown(breakdowns))
    skipped = [] if PUSH in plan.setups else ["(2) 1P1D push: in the full run only"]
    if not breakdowns:
        skipped.append("breakdown and transfer_share: no answer carried the admission's `kvmesh.timings_ms`")
    rate, key = sweeps["arxiv"][-1].rate, "p90_latency_reduction_vs_colocated"
    pull, colocated = summarize(measured[("pull", "arxiv")]), summarize(measured[("colocated", "arxiv")])
    rates = {w: {"colocated": sweeps[w][-1].rate, **{s.key: 2 * sweeps[w][-1].rate for s in plan.setups}}
             for w in plan.workloads}
    return BenchResult(
        bench="serve", quick=quick, ratios=ratios, targets=dict(TARGETS), ceilings=ceilings,
        directions=dict.fromkeys(AT_MOST, "<="),
        config={**_config(plan, sweeps, breakdowns, skipped), "rate_rps": rates}, rows=rows,
        plots=[str(p) for p in plots],
        headline=f"arxiv: (1) 1P1D pull at {2 * rate:g} req/s has P90 end-to-end latency (every request) "
                 f"{pull['e2e_p90_every_ms']:.0f} ms against {colocated['e2e_p90_every_ms']:.0f} ms for (3) one "
                 f"colocated engine at {rate:g} req/s ({pull['failed']:.0f} and {colocated['failed']:.0f} failed): "
                 f"{key} = {ratios[key]:.2f} (target >= {TARGETS[key]:g})")


def _transfer_share(load: LoadResult) -> float | None:
    """Transfer time over end-to-end time, summed over the requests that carried kvmesh's timings."""
    timed = [r for r in load.results if r.ok and r.kvmesh and "timings_ms" in r.kvmesh]
    if not timed:
        return None
    return sum(r.kvmesh["timings_ms"].get("transfer", 0.0) for r in timed) / sum(r.e2e * 1e3 for r in timed)


def _config(plan: Plan, sweeps: dict[str, list[LoadResult]], breakdowns: dict[str, dict[str, float]],
            skipped: list[str]) -> dict:
    return {
        "workloads": {w: _workload_config(WORKLOADS[w]) for w in plan.workloads},
        "sweep_rps": {w: [load.rate for load in sweeps[w]] for w in plan.workloads},
        "tbt_doubled": {w: bool(_tbt(sweeps[w][-1]) >= 2 * _tbt(sweeps[w][0])) for w in plan.workloads},
        "window_s": plan.window_s, "drain_s": plan.drain_s, "min_requests": plan.min_requests,
        "model": MODEL, "concurrency": CONCURRENCY, "torch_threads_per_engine": 1, "cpus": os.cpu_count(), "seed": SEED,
        "breakdown_ms": breakdowns, "skipped": skipped,
    }


def _workload_config(workload: Workload) -> dict:
    return {"prompt_mean": workload.prompt.mean, "prompt_range": [workload.prompt.low, workload.prompt.high],
            "output_mean": workload.output.mean, "output_range": [workload.output.low, workload.output.high],
            "paper_prompt_mean": workload.paper_prompt_mean, "paper_output_mean": workload.paper_output_mean}


def _target_result(target: str, plan: Plan, quick: bool, sweeps: dict[str, list[LoadResult]]) -> BenchResult:
    """Another server under the same workloads and sweep: its percentiles at each rate."""
    rows = [_row("target", w, load) for w in plan.workloads for load in sweeps[w]]
    ratios = {f"tbt_growth_{w}": _tbt(sweeps[w][-1]) / _tbt(sweeps[w][0]) for w in plan.workloads}
    ceilings = {f"light_{key}_{w}": summarize(sweeps[w][0])[key] for w in plan.workloads
                for key in ("ttft_p50_ms", "tbt_p50_ms", "e2e_p50_ms")}
    plots = [_plot_latency(plan, sweeps, {("target", w): sweeps[w][-1] for w in plan.workloads})]
    breakdowns = {f"target / {w}": b for w in plan.workloads if (b := breakdown(sweeps[w][-1])) is not None}
    if breakdowns:
        plots.append(_plot_breakdown(breakdowns))
    last = summarize(sweeps[plan.workloads[0]][-1])
    return BenchResult(
        bench="serve", quick=quick, ratios=ratios, targets={}, ceilings=ceilings,
        config={**_config(plan, sweeps, breakdowns, []), "target": target}, rows=rows,
        plots=[str(p) for p in plots],
        headline=f"{target}: {plan.workloads[0]} at {last['offered_rps']:g} req/s: P90 TTFT {last['ttft_p90_ms']:.0f} ms, "
                 f"P90 TBT {last['tbt_p90_ms']:.1f} ms, P90 end to end {last['e2e_p90_ms']:.0f} ms; "
                 f"tbt_growth_{plan.workloads[0]} = {ratios[f'tbt_growth_{plan.workloads[0]}']:.2f}")


# -- plots ----------------------------------------------------------------------------------------


def _plot_latency(plan: Plan, sweeps: dict[str, list[LoadResult]],
                  measured: dict[tuple[str, str], LoadResult]) -> Path:
    """Per workload: the CDF of end-to-end latency per configuration, and P50 TBT over the sweep."""
    fig, axes = plt.subplots(2, len(plan.workloads), figsize=(6 * len(plan.workloads), 7), squeeze=False)
    for column, w in enumerate(plan.workloads):
        cdf, sweep = axes[0][column], axes[1][column]
        for (label, workload), load in measured.items():
            if workload == w:
                ms = np.sort([r.e2e * 1e3 for r in load.results if r.ok])
                cdf.plot(ms, np.arange(1, len(ms) + 1) / max(1, len(ms)), label=f"{label} @ {load.rate:g} req/s")
        cdf.set_xscale("log")
        cdf.set_xlabel("end-to-end latency (ms, log scale)")
        cdf.set_ylabel("fraction of requests")
        cdf.set_title(f"{w}: end-to-end latency")
        cdf.legend(fontsize=8)
        rates, tbts = [load.rate for load in sweeps[w]], [_tbt(load) for load in sweeps[w]]
        sweep.plot(rates, tbts, marker="o", label="P50 TBT")
        sweep.axhline(2 * tbts[0], linestyle="--", color="grey", label="2x the light load's")
        sweep.set_xlabel("offered requests/s")
        sweep.set_ylabel("P50 TBT (ms)")
        sweep.set_title(f"{w}: calibration sweep")
        sweep.legend(fontsize=8)
        for ax in (cdf, sweep):
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return _save(fig, LATENCY_PLOT)


def _plot_breakdown(breakdowns: dict[str, dict[str, float]]) -> Path:
    """Mean time per stage, stacked, one bar per configuration and workload (KVDirect Fig. 14)."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(breakdowns)))
    labels = list(breakdowns)
    left = np.zeros(len(labels))
    for stage in STAGES:
        widths = np.array([breakdowns[label][stage] for label in labels])
        ax.barh(labels, widths, left=left, label=stage.replace("_", " "))
        left += widths
    ax.invert_yaxis()
    ax.set_xlabel("mean time per request (ms)")
    ax.set_title("latency breakdown (KVDirect Fig. 14)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, ncols=len(STAGES), loc="upper center",
               bbox_to_anchor=(0.5, 0.0))
    return _save(fig, BREAKDOWN_PLOT)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
