"""A paper experiment's sweep: simulated clusters, each at a rate on a workload, run one after another
under a progress bar, with the figures the papers plot and how fast the simulator ran.

A point's `rate` is per engine (the papers' "per-node QPS"): its cluster gets `rate` times its engine
count, so one colocated engine at r is compared with a 1P1D pair at 2r."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.progress import Progress

from .. import cluster
from ..engine import EngineSpec
from ..link import KVGeometry, LinkSpec
from ..metrics import summarise
from ..request import SimRequest
from ..step_cost import StepCost
from ..topology import Topology
from ..workload import Lengths, poisson, replay


@dataclass(frozen=True, slots=True)
class Point:
    series: str                  # what is compared, e.g. "vllm", "kvdirect", "push"
    workload: str                # the data set's shape, e.g. "arxiv"
    rate: float                  # requests per second per engine
    topology: Topology
    prompt: Lengths
    output: Lengths
    spec: EngineSpec
    requests: int
    seed: int
    max_context: int             # prompt and output together at most (the model's context window)
    link: LinkSpec = field(default_factory=LinkSpec)
    transfer_mode: str = "pull"
    routing: str = "round_robin"  # with pd:1:1 every request is split, as KVDirect's 1P1D
    step_overhead_s: float = 0.0  # added to every step (a variation of the step cost)
    variant: str = ""            # the assumption this point varies ("": the experiment's own)

    @property
    def engines(self) -> int:
        return len(self.topology.roles())


@dataclass(frozen=True, slots=True)
class Overhead:
    """A step cost with a fixed time added to every step."""

    cost: StepCost
    added_s: float

    def seconds(self, *shape: int) -> float:
        return self.cost.seconds(*shape) + self.added_s


@dataclass(frozen=True, slots=True)
class Outcome:
    point: Point
    figures: dict   # sim.metrics.summarise's, with `figures`' own


def requests(point: Point) -> list[SimRequest]:
    """The point's Poisson arrivals at its cluster's rate, each request cut to the context window: its
    output to half of it, its prompt to what is left (a data set's longest documents are truncated)."""
    drawn = poisson(point.rate * point.engines, point.requests, point.prompt, point.output, point.seed)
    outputs = [min(r.max_tokens, point.max_context // 2) for r in drawn]
    prompts = [min(r.prompt_len, point.max_context - o) for r, o in zip(drawn, outputs)]
    return replay([r.arrival for r in drawn], prompts, outputs)


def simulate(point: Point, cost: StepCost, geometry: KVGeometry) -> Outcome:
    workload = requests(point)
    if point.step_overhead_s:
        cost = Overhead(cost, point.step_overhead_s)
    engines = cluster.build(point.topology, point.spec, cost, None, point.routing, point.link, geometry,
                            point.transfer_mode)
    start = time.perf_counter()
    sim_seconds = engines.run(workload)
    return Outcome(point, summarise(workload, sim_seconds, time.perf_counter() - start) | figures(workload))


def figures(requests: Sequence[SimRequest]) -> dict:
    """What the papers plot beyond `summarise`: mean end-to-end latency, mean TTFT, and TBT (each request's
    mean time between tokens after the first) at P90 and mean, in seconds; None when nothing finished."""
    done = [r for r in requests if r.finished_at is not None]
    tbt = [(r.finished_at - r.token_times[0]) / (r.num_generated - 1) for r in done if r.num_generated > 1]
    return {"e2e_mean_s": _mean([r.finished_at - r.arrival for r in done]),
            "ttft_mean_s": _mean([r.token_times[0] - r.arrival for r in done]),
            "tbt_p90_s": float(np.percentile(tbt, 90)) if tbt else None, "tbt_mean_s": _mean(tbt)}


def run(points: Sequence[Point], cost: StepCost, geometry: KVGeometry, title: str,
        simulate_point: Callable[[Point, StepCost, KVGeometry], Outcome] = simulate) -> list[Outcome]:
    """Every point in turn, a progress bar (on stderr) over them; `simulate_point` a paper's own
    (sim/papers/cacheopt.py: per-request predicted lengths and SLOs, engine policies per point)."""
    outcomes = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(title, total=len(points))
        for point in points:
            progress.update(task, description=f"{title}: {point.workload} {point.series} {point.variant} "
                                              f"@ {point.rate:g} req/s per engine")
            outcomes.append(simulate_point(point, cost, geometry))
            progress.advance(task)
    return outcomes


def speed(outcomes: Sequence[Outcome]) -> dict:
    """Simulated seconds per wall second over the whole sweep."""
    simulated = sum(o.figures["sim_seconds"] for o in outcomes)
    wall = sum(o.figures["wall_seconds"] for o in outcomes)
    return {"sim_seconds": simulated, "wall_seconds": wall, "sim_per_wall": simulated / wall if wall > 0 else None}


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None
