"""CacheOpt's allocation on stock vLLM (issues 7 and 10): KVMeshScheduler's kv_allocation and
preemption policies against stock vLLM's own scheduler, on the same requests, in one run.

The trace of `kvmesh bench cacheopt` (real instructions, SmolLM2's own answer lengths scaled by 1/4)
with that bench's embedding predictor (trained on the file's 480 training instructions, 200 with
--quick). Two vLLM instances (its CPU
build from .venv-vllm, on the same core, one measured at a time, the `tiny` model in float32, 32-token
blocks, `bench cacheopt`'s KV pool: about 3 mean requests, at least 2 of the longest): one with stock
vLLM's scheduler, the baseline a vLLM user runs, and one with KVMeshScheduler, whose policies are
switched between runs. A request ends at its trace length (the instance aborts it there, as if it
sampled EOS) while its max_tokens is the trace's longest output, so no policy reads its length. The
block baseline's capacity is measured with every request there at once; each method then serves
the same Poisson arrivals at fractions of it. SLOs as `bench cacheopt` sets them: the SLO-unaware
methods' mean TTFT and TBT x U(0.5, 2.5) per request.

Methods (KVMeshScheduler's policies; the request's estimated length):
  block      stock vLLM's scheduler (not KVMeshScheduler)      no estimate read
  rlp        estimate, latest arrival preempted first (vLLM's) predicted + 100 tokens (scaled)
  cacheopt   cacheopt allocation and preemption order          Eq. 3-4 padding in the predicted direction
  guarded    the same with kvmesh's victim guard               the same
  oracle     as cacheopt                                       the true length: the ceiling of allocation
                                                               by estimate
KVMeshScheduler's ledger keeps one block (32 tokens, 2-4% of the pool) as CacheOpt's global
reservation; stock vLLM keeps none. Preemptions under stock vLLM are the preempted ids its steps
report (vllm_instance's count).

Keys, at the highest rate the block baseline sustains (normalised latency at most twice its own at
the lowest rate), as in `bench cacheopt`: p99_tbt_ratio_block_vs_cacheopt,
p99_ttft_ratio_block_vs_cacheopt (issue 7's targets 2 and 1.5), slo_attainment_cacheopt,
slo_attainment_block, preemptions_block, preemptions_cacheopt; the oracle's in the ceilings.
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from rich.progress import Progress

from kvmesh.services.engine.native.models import PRESETS, save_preset_checkpoint
from kvmesh.services.predictor.encoder import encoder

from .cacheopt import (SUSTAIN_FACTOR, TRACES, Method, Slos, estimates, metrics_of, plot_sweep, pool_blocks,
                       predictions, summary_at_rates)
from .cacheopt_serving import RunStats, Served
from .instruction_trace import InstructionTrace
from .loadgen import poisson_arrivals
from .report import BenchResult, Row
from .vllm_instance import BLOCK_SIZE
from .vllm import read_answers
from .vllm_process import VllmProcess, vllm_missing

MODEL = "tiny"
TRACE = "instructions"
LOGS = Path("bench-results/vllm-logs")
PLOT = Path("bench-results/vllm_cacheopt.png")
RATE_FRACTIONS = (0.6, 0.9, 1.2)
RESERVED_BLOCKS = 1
MAX_NUM_SEQS = 64  # well past what the pool holds: KV, not the sequence limit, is what the methods compete for
STALL_S = 120.0    # a run with no request ending for this long has hung

VLLM_ORDER = {"preemption_order": "latest_arrival_first", "prefill_admission": "fcfs"}
COOPT = {"kv_allocation": "cacheopt", "preemption_order": "cacheopt", "prefill_admission": "fcfs"}
METHODS = (Method("block", {}, "none"),   # no policies: stock vLLM's scheduler
           Method("rlp", {"kv_allocation": "estimate", **VLLM_ORDER}, "rlp"),
           Method("cacheopt", COOPT, "ours"),
           Method("guarded", {**COOPT, "kv_allocation": "cacheopt_guarded"}, "ours"),
           Method("oracle", COOPT, "oracle"))
SLO_UNAWARE = ("block", "rlp")


def run(quick: bool) -> BenchResult:
    missing = vllm_missing()
    if missing:
        raise RuntimeError(f"kvmesh bench vllm_cacheopt needs vLLM: {missing}")
    trace = TRACES[TRACE]
    n, n_train = (30, 200) if quick else (150, None)   # None: every training instruction
    fractions = RATE_FRACTIONS[::2] if quick else RATE_FRACTIONS
    requests = trace.requests(n, seed=1)
    blocks = pool_blocks(trace, BLOCK_SIZE)
    runs: dict[tuple[str, float], RunStats] = {}
    planned: dict[str, int] = {}   # by method@rate: preemptions the allocation plan named
    LOGS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir, Progress(transient=True) as progress:
        task = progress.add_task("predictor", total=None)
        predicted = predictions(trace, requests, n_train, encoder())
        model = save_preset_checkpoint(MODEL, Path(workdir) / "model", seed=0)
        progress.update(task, description="starting vLLM")
        common = dict(connector="none", kv_bytes=(blocks + 1) * _block_bytes(),   # and vLLM's null block
                      max_model_len=trace.prompt.high + trace.output.high, max_num_seqs=MAX_NUM_SEQS)
        stock = VllmProcess(model, "kv_both", "0", LOGS / "cacheopt-stock.log", **common)
        ours = VllmProcess(model, "kv_both", "0", LOGS / "cacheopt.log", **common,
                           scheduler={"policies": METHODS[1].policies, "allocation": {"reserved_blocks": RESERVED_BLOCKS}})
        try:
            stock.ready()
            ours.ready()
            on_stock, on_ours = _Driver(stock), _Driver(ours)
            drivers = {m.name: on_ours if m.policies else on_stock for m in METHODS}
            progress.update(task, description="capacity", total=(len(METHODS) * len(fractions) + 1) * n)
            capacity = _capacity(drivers["block"], trace, requests, lambda: progress.advance(task))
            rates = [capacity * f for f in fractions]
            slos = Slos(trace, requests)
            for method in METHODS:   # SLO-unaware first: their means set everyone's SLOs
                for rate in rates:
                    progress.update(task, description=f"{method.name} at {rate:.1f} req/s")
                    lengths = ([r.output_len for r in requests] if method.estimate == "oracle"
                               else estimates(method.estimate, trace, requests, predicted, rate))
                    targets = [{"ttft_slo_ms": t, "tbt_slo_ms": b, **({"predicted_output_len": e} if e else {})}
                               for e, t, b in zip(lengths, *slos.ms())]
                    driver = drivers[method.name]
                    runs[method.name, rate] = driver.serve(method, requests, poisson_arrivals(n, rate, seed=2),
                                                           targets, trace.output.high, lambda: progress.advance(task))
                    planned[f"{method.name}@{rate:.1f}"] = driver.planned
                if method.name == SLO_UNAWARE[-1]:
                    slos.calibrate([runs[m, r] for m in SLO_UNAWARE for r in rates])
        finally:
            stock.stop()
            ours.stop()
    rows: list[Row] = []
    metrics = {key: metrics_of(stats, slos) for key, stats in runs.items()}
    summary = summary_at_rates(TRACE, rates, metrics, METHODS, rows)
    at = summary["at_rate"]
    block, ours, oracle = (metrics[m, at] for m in ("block", "cacheopt", "oracle"))
    ratios = {"p99_tbt_ratio_block_vs_cacheopt": summary["tbt_ratio"],
              "p99_ttft_ratio_block_vs_cacheopt": summary["ttft_ratio"],
              "slo_attainment_cacheopt": summary["slo_cacheopt"], "slo_attainment_block": summary["slo_block"],
              "preemptions_block": block.preemptions, "preemptions_cacheopt": ours.preemptions}
    targets = {"p99_tbt_ratio_block_vs_cacheopt": 2.0, "p99_ttft_ratio_block_vs_cacheopt": 1.5}
    return BenchResult(
        bench="vllm_cacheopt", quick=quick, ratios=ratios, targets=targets,
        ceilings={"p99_tbt_ratio_block_vs_oracle": block.p99_tbt_ms / oracle.p99_tbt_ms,
                  "p99_ttft_ratio_block_vs_oracle": block.p99_ttft_ms / oracle.p99_ttft_ms,
                  "slo_attainment_oracle": oracle.slo_attainment, "preemptions_oracle": oracle.preemptions},
        config={"trace": TRACE, "requests_per_run": n, "train_requests": n_train, "model": MODEL, "dtype": "float32",
                "block_size": BLOCK_SIZE, "pool_blocks": blocks, "reserved_blocks": RESERVED_BLOCKS,
                "capacity_req_s": capacity, "rate_fractions_of_capacity": list(fractions),
                "sustained_req_s": summary["sustained"], "planned_preemptions": planned, "compared_at_req_s": at,
                "sustain_factor": SUSTAIN_FACTOR,
                "methods": {m.name: {"policies": m.policies, "estimate": m.estimate} for m in METHODS}},
        rows=rows, plots=[plot_sweep({TRACE: summary}, methods=METHODS, path=PLOT)],
        headline=(f"vLLM at {at:.1f} req/s: P99 TBT {ratios['p99_tbt_ratio_block_vs_cacheopt']:.2f}x and P99 TTFT "
                  f"{ratios['p99_ttft_ratio_block_vs_cacheopt']:.2f}x lower with KVMeshScheduler's CacheOpt than "
                  f"vLLM's block allocation; preemptions {ours.preemptions} vs {block.preemptions}; SLO attainment "
                  f"{ratios['slo_attainment_cacheopt']:.2f} vs {ratios['slo_attainment_block']:.2f}"))


def _block_bytes() -> int:
    spec = PRESETS[MODEL]
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * BLOCK_SIZE * 4   # K and V, float32


def _capacity(driver: _Driver, trace: InstructionTrace, requests, advance) -> float:
    """Requests per second vLLM's block allocation completes with every request there at once."""
    stats = driver.serve(METHODS[0], requests, np.zeros(len(requests)), [None] * len(requests), trace.output.high,
                         advance)
    return float(len(requests) / max(s.times[-1] - s.arrival for s in stats.served))


class _Driver:
    """Sends a run's requests to the instance as they arrive and collects their token times."""

    def __init__(self, instance: VllmProcess):
        self.instance = instance
        self.answers: queue.Queue = queue.Queue()
        self.planned = 0   # the last run's preemptions the allocation plan named (the rest: vLLM's, out of blocks)
        threading.Thread(target=read_answers, args=(instance, 0, self.answers), daemon=True).start()

    def ask(self, op: str, **fields: object) -> dict:
        self.instance.send(op, **fields)
        return self.answers.get(timeout=STALL_S)[1]

    def serve(self, method: Method, requests, arrivals: np.ndarray, targets: list[dict | None], max_tokens: int,
              advance) -> RunStats:
        if method.policies:   # KVMeshScheduler's; stock vLLM's scheduler has none to switch
            self.ask("policies", policies=method.policies)
        before = self.ask("scheduler")
        start = time.time() + 0.2
        times: dict[int, list[float]] = {}
        sent = 0
        while len(times) < len(requests):
            while sent < len(requests) and time.time() >= start + arrivals[sent]:
                request = requests[sent]
                self.instance.send("add", id=str(sent), prompt=request.prompt_ids, max_tokens=max_tokens,
                                   targets=targets[sent], stop_after=request.output_len)
                sent += 1
            try:
                _, answer = self.answers.get(timeout=0.002 if sent < len(requests) else STALL_S)
            except queue.Empty:
                if sent < len(requests):
                    continue
                raise RuntimeError(f"{method.name}: {len(requests) - len(times)} requests unanswered after "
                                   f"{STALL_S:g} s") from None
            times[int(answer["done"])] = answer["token_times"]
            advance()
        after = self.ask("scheduler")
        preempted = after["preemptions"] - before["preemptions"]
        self.planned = after["planned_preemptions"] - before["planned_preemptions"]
        served = [Served(start + arrivals[i], times[i], 0) for i in range(len(requests))]
        return RunStats(served, {"recompute": preempted}, max(s.times[-1] for s in served) - start)
