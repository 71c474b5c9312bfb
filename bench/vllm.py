"""kvmesh's KV connector between stock vLLM instances, against vLLM's own and against one instance.

vLLM's CPU build (.venv-vllm) serves the `small` preset (8 layers, float32), each instance in its
own process bound to one core; this harness sends requests as they arrive (Poisson) and hands
each prefill's output to the decode instance the moment it is done, as a disaggregating proxy does.

Setups (the same requests, in one run):
  kvmesh     prefill instance (core 0) -> decode instance (core 1), KVMeshConnector over the tcp
             data plane: the decode worker pulls the prompt's blocks one-sided, then COMPLETEs
  kvmesh_shm the same over the shm data plane: the decode worker reads the prefill instance's KV
             cache (vLLM's private memory) by cross-memory attach, the kernel copying
  nixl       the same two instances with vLLM's NixlConnector, its production P/D connector: the
             decode worker reads the prompt's blocks from the prefill instance's KV cache (host
             memory on vLLM's CPU build) through NIXL (UCX); needs `nixl` in .venv-vllm (make peers)
  example    the same two instances with vLLM's ExampleConnector: the prefill saves each layer's KV
             to files in shared storage, the decode loads them
  colocated  one instance (core 0), no connector, at half the request rate: half the hardware
             for half the load
The workload is arXiv-shaped (bench/workloads.py: long prompts, short answers). For each setup and
rate: TTFT (arrival to the decode instance's first token), TBT, end-to-end latency, P50/P90; and
the hand-off rate, KV bytes of the loaded prompt blocks over the time from the prefill's end to the
decode's first token (what a client waits for the hand-off, the decode's first step included).

Keys, each read at a rate stated here, before the run:
- p90_latency_ratio_nixl_vs_kvmesh (P90 end-to-end latency, target > 1: NixlConnector is the P/D
  baseline a vLLM user would choose), and beside it the same against ExampleConnector and for the
  shm data plane, at the peers' rate: the highest rate at which no P/D setup collapsed (its P90
  latency within COLLAPSE times its own at the lowest rate), the lowest if every one did. A rate
  where a baseline's queue runs away would make any ratio there large. Every rate's ratio is
  reported too (..._at_<rate>).
- p90_latency_reduction_vs_colocated (1 - kvmesh / colocated P90 end-to-end, target 0.3), at the
  colocated rate: the lowest at which colocated's mean TBT is twice its own at the lowest rate, else
  the highest (KVDirect's framing: disaggregation pays once a colocated engine's prefills stall its
  decodes; the mean, since a stall shows there and not in the median of the gaps).
- kv_gbps_<setup>: the hand-off's GB/s at the peers' rate.
"""

from __future__ import annotations

import math
import queue
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.progress import Progress

from kvmesh.infra.local.processes import free_port
from kvmesh.services.engine.native.models import PRESETS, save_preset_checkpoint

from .report import BenchResult, Row, save_figure
from .vllm_instance import BLOCK_SIZE
from .vllm_process import VllmProcess, nixl_missing, vllm_missing
from .workloads import ARXIV, WorkRequest

MODEL = "small"
# Requests/s to the disaggregated pair; colocated gets half. Up to where the pair's one prefill instance
# saturates on this machine (about 200 ms a prompt), which is about where colocated's mean TBT doubles.
RATES = (1.0, 2.0, 3.0, 4.0, 5.0)
REQUESTS, QUICK_REQUESTS = 48, 16
SETUPS = ("kvmesh", "kvmesh_shm", "nixl", "example", "colocated")
BACKENDS = {"kvmesh": "tcp", "kvmesh_shm": "shm"}   # the kvmesh connector's data plane, by setup
PULLED = (*BACKENDS, "nixl")   # setups whose decode instance reads the prompt's KV from the prefill instance
PEERS = ("nixl", "example")    # vLLM's own connectors, compared with kvmesh's
COLLAPSE = 3.0   # a P/D setup whose P90 latency is past this times its own at the lowest rate has collapsed
TARGETS = {"p90_latency_ratio_nixl_vs_kvmesh": 1.0, "p90_latency_reduction_vs_colocated": 0.3}
PLOT = Path("bench-results/vllm.png")
LOGS = Path("bench-results/vllm-logs")   # each instance's output, by setup and rate
STALL_S = 60.0   # no answer for this long once every request is sent: something is wrong


@dataclass
class Run:
    arrival: list[float] = field(default_factory=list)
    prefill_end: list[float] = field(default_factory=list)   # P/D: when the prefill instance was done
    token_times: list[list[float]] = field(default_factory=list)
    added: list[float] = field(default_factory=list)   # when the instance that answers took each request in
    cached: list[int] = field(default_factory=list)    # prompt tokens it did not compute (loaded, for P/D)
    kv_bytes: list[int] = field(default_factory=list)
    pulls: dict[str, list[float]] = field(default_factory=dict)   # kvmesh: the decode worker's pull reports

    def figures(self) -> dict[str, float]:
        ttft = np.array([t[0] - a for t, a in zip(self.token_times, self.arrival)])
        e2e = np.array([t[-1] - a for t, a in zip(self.token_times, self.arrival)])
        tbt = np.concatenate([np.diff(t) for t in self.token_times])
        out = {f"P{q} {name} ms": float(np.percentile(v, q) * 1e3)
               for name, v in (("TTFT", ttft), ("TBT", tbt), ("latency", e2e)) for q in (50, 90)}
        out["mean TBT ms"] = float(tbt.mean() * 1e3)
        if self.prefill_end:
            handoff = sum(t[0] - end for t, end in zip(self.token_times, self.prefill_end))
            out["hand-off GB/s"] = sum(self.kv_bytes) / handoff / 1e9
            out["P50 hand-off ms"] = float(np.median([t[0] - end for t, end in zip(self.token_times,
                                                                                   self.prefill_end)]) * 1e3)
        if self.pulls:
            out["pull GB/s"] = sum(self.pulls["bytes"]) / sum(self.pulls["reads_seconds"]) / 1e9
            out["P50 pull ms"] = float(np.median(self.pulls["seconds"]) * 1e3)
        return out


def run(quick: bool) -> BenchResult:
    missing = vllm_missing()
    if missing:
        raise RuntimeError(f"kvmesh bench vllm needs vLLM: {missing}")
    n = QUICK_REQUESTS if quick else REQUESTS
    rates = RATES[::2] if quick else RATES
    requests = ARXIV.requests(n, seed=11)
    nixl = nixl_missing()
    setups = [s for s in SETUPS if s != "nixl" or nixl is None]   # without NIXL its keys stay, missing
    results: dict[tuple[str, float], Run] = {}
    with tempfile.TemporaryDirectory() as workdir, Progress(transient=True) as progress:
        model = save_preset_checkpoint(MODEL, Path(workdir) / "model", seed=0)
        task = progress.add_task("vllm", total=len(setups) * len(rates) * n)
        for setup in setups:
            for rate in rates:
                progress.update(task, description=f"{setup} at {rate:g} req/s")
                results[setup, rate] = _run(setup, model, Path(workdir), requests,
                                            rate / 2 if setup == "colocated" else rate,
                                            lambda: progress.advance(task))
    figures = {key: r.figures() for key, r in results.items()}
    ratios = keys(figures, setups, rates)
    compared, peers_rate = ratios["colocated_rate"], ratios["peers_rate"]
    base_tbt = figures["colocated", rates[0]]["mean TBT ms"]
    paired = [s for s in setups if s != "colocated"]
    p90 = defaultdict(lambda: math.nan, {key: f["P90 latency ms"] for key, f in figures.items()})
    rows = [Row(compared=f"{rate:g} req/s" + (" (colocated: half)" if setup == "colocated" else ""), path=setup,
                cells=figures[setup, rate]) for rate in rates for setup in setups]
    spec = PRESETS[MODEL]
    return BenchResult(
        bench="vllm", quick=quick, ratios=ratios, targets=dict(TARGETS), directions={"p90_latency_ratio_nixl_vs_kvmesh": ">"},
        ceilings={"memcpy_gbps": memcpy_gbps()},
        config={"model": MODEL, "dtype": "float32", "block_size": BLOCK_SIZE, "requests": n, "rates": list(rates),
                "workload": "arxiv", "kv_bytes_per_token": 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4,
                "cores": "prefill 0, decode 1; colocated 0", "data_planes": BACKENDS, "collapse": COLLAPSE,
                **({"nixl_missing": nixl} if nixl else {})},
        rows=rows, plots=[_plot(figures, setups, rates, 2 * base_tbt)],
        headline=(f"at {peers_rate:g} req/s: P90 latency (ms) " + ", ".join(
                      f"{setup} {p90[setup, peers_rate]:,.0f}" for setup in paired)
                  + f"; hand-off {ratios['kv_gbps_kvmesh']:.2f} (tcp), {ratios['kv_gbps_kvmesh_shm']:.2f} (shm), "
                  f"{ratios['kv_gbps_nixl']:.2f} (nixl), {ratios['kv_gbps_example']:.2f} (example) GB/s; against "
                  f"colocated at {compared:g} req/s: {ratios['p90_latency_reduction_vs_colocated']:.2f} lower P90"))


def keys(figures: dict[tuple[str, float], dict[str, float]], setups: list[str], rates: tuple[float, ...]) -> dict[str, float]:
    """The keys from each measured (setup, rate)'s figures, read at the rates the docstring states; a
    setup not measured (NIXL absent) leaves its keys NaN, so their targets are missed, not dropped."""
    base_tbt = figures["colocated", rates[0]]["mean TBT ms"]
    compared = next((r for r in rates if figures["colocated", r]["mean TBT ms"] >= 2 * base_tbt), rates[-1])
    paired = [s for s in setups if s != "colocated"]
    standing = [r for r in rates if all(figures[s, r]["P90 latency ms"] <= COLLAPSE * figures[s, rates[0]]["P90 latency ms"]
                                        for s in paired)]
    peers_rate = standing[-1] if standing else rates[0]
    p90 = defaultdict(lambda: math.nan, {key: f["P90 latency ms"] for key, f in figures.items()})
    ratios = {"p90_latency_reduction_vs_colocated": 1 - p90["kvmesh", compared] / p90["colocated", compared],
              "colocated_rate": compared, "peers_rate": peers_rate}
    for peer in PEERS:
        for ours in BACKENDS:
            key = f"p90_latency_ratio_{peer}_vs_{ours}"
            ratios[key] = p90[peer, peers_rate] / p90[ours, peers_rate]
            ratios.update({f"{key}_at_{r:g}": p90[peer, r] / p90[ours, r] for r in rates})
    ratios.update({f"kv_gbps_{s}": figures[s, peers_rate]["hand-off GB/s"] if s in paired else math.nan
                   for s in SETUPS if s != "colocated"})
    return ratios


def _run(setup: str, model: Path, workdir: Path, requests: list[WorkRequest], rate: float, advance) -> Run:
    logs = LOGS / f"{setup}-{rate:g}"
    logs.mkdir(parents=True, exist_ok=True)
    if setup == "colocated":
        instances = [VllmProcess(model, "kv_both", "0", logs / "colocated.log", connector="none")]
    else:
        # A fresh storage path each run: the prefill instance would otherwise load the KV an earlier
        # run saved for the same prompts, and skip its prefill.
        settings = ({"shared_storage_path": str(workdir / f"kv-files-{rate:g}")} if setup == "example"
                    else {"backend": BACKENDS[setup]} if setup in BACKENDS else {})
        connector = setup if setup in PEERS else "kvmesh"
        # kvmesh's prefill side listens on its data port; each NixlConnector instance on a side channel.
        ports = {"kvmesh": (free_port(), 0), "nixl": (free_port(), free_port()), "example": (0, 0)}[connector]
        instances = [VllmProcess(model, "kv_producer", "0", logs / f"{setup}-prefill.log", connector, ports[0],
                                 **settings),
                     VllmProcess(model, "kv_consumer", "1", logs / f"{setup}-decode.log", connector, ports[1],
                                 **settings)]
    try:
        for instance in instances:
            instance.ready()
        return _drive(instances, requests, rate, setup, advance)
    finally:
        for instance in instances:
            instance.stop()


def _drive(instances: list[VllmProcess], requests: list[WorkRequest], rate: float, setup: str, advance) -> Run:
    """Send `requests` at Poisson arrivals of `rate`; P/D: each prefill's end sends its decode."""
    answers: queue.Queue = queue.Queue()
    for index, instance in enumerate(instances):
        threading.Thread(target=read_answers, args=(instance, index, answers), daemon=True).start()
    gaps = np.random.default_rng(7).exponential(1 / rate, len(requests))
    start = time.time() + 0.5
    arrivals = list(start + np.cumsum(gaps))
    run = Run(arrival=arrivals, prefill_end=[0.0] * len(requests) if len(instances) > 1 else [],
              token_times=[[] for _ in requests], added=[0.0] * len(requests), cached=[0] * len(requests),
              kv_bytes=[0] * len(requests))
    sent, finished = 0, 0
    while finished < len(requests):
        while sent < len(requests) and time.time() >= arrivals[sent]:
            request = requests[sent]
            if len(instances) == 1:
                instances[0].send("add", id=str(sent), prompt=request.prompt_ids, max_tokens=request.max_tokens)
            else:
                instances[0].send("add", id=str(sent), prompt=request.prompt_ids, max_tokens=1,
                                  params={"do_remote_decode": True} if setup in PULLED else None)
            sent += 1
        try:
            index, answer = answers.get(timeout=0.005 if sent < len(requests) else STALL_S)
        except queue.Empty:
            if sent < len(requests):
                continue
            waiting = [i for i, times in enumerate(run.token_times) if not times]
            prefilled = [i for i in waiting if run.prefill_end and run.prefill_end[i]]
            raise RuntimeError(f"{setup}: requests {waiting} unanswered after {STALL_S:g} s (of them, {prefilled} "
                               "were prefilled)") from None
        i = int(answer["done"])
        if index == 0 and len(instances) > 1:   # a prefill is done: its decode goes out now
            run.prefill_end[i] = answer["token_times"][-1]
            run.kv_bytes[i] = _kv_bytes(len(requests[i].prompt_ids))
            instances[1].send("add", id=str(i), prompt=requests[i].prompt_ids, max_tokens=requests[i].max_tokens,
                              params=answer["kv_transfer_params"])
            continue
        run.token_times[i] = answer["token_times"]
        run.added[i] = answer["added"]
        run.cached[i] = answer["cached_tokens"]
        finished += 1
        advance()
    if setup in BACKENDS:
        instances[1].send("pulls")
        run.pulls = answers.get(timeout=STALL_S)[1]
    return run


def read_answers(instance: VllmProcess, index: int, answers: queue.Queue) -> None:
    try:
        while True:
            answers.put((index, instance.answer()))
    except (RuntimeError, ValueError):   # it exited
        return


def _kv_bytes(prompt_tokens: int) -> int:
    """The KV of the prompt's whole blocks but its last token's: what a decode instance loads."""
    spec = PRESETS[MODEL]
    tokens = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    return tokens * 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4


def memcpy_gbps() -> float:
    """One 64 MB copy between two host buffers: the ceiling of a same-host hand-off."""
    source, target = np.ones(64 << 20, dtype=np.uint8), np.empty(64 << 20, dtype=np.uint8)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return source.nbytes / best / 1e9


def _plot(figures: dict, setups: list[str], rates: tuple[float, ...], doubled_tbt_ms: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    doubled = axes[1].axhline(doubled_tbt_ms, color="grey", linestyle="--", linewidth=1,
                              label="colocated's at the lowest rate, doubled")
    for ax, metric in zip(axes, ("P90 TTFT ms", "mean TBT ms", "P90 latency ms")):
        for setup in setups:
            ax.plot(rates, [figures[setup, r][metric] for r in rates], marker="o",
                    label=setup + (" (at half the rate)" if setup == "colocated" else ""))
        ax.set_xlabel("requests/s to the P/D pair")
        ax.set_title(metric, fontsize=9)
    axes[0].legend(fontsize=8)
    axes[1].legend(handles=[doubled], fontsize=8)
    return save_figure(fig, PLOT)
