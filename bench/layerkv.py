"""LayerKV (issue 8) against FCFS with every layer on the device (vLLM), in one run.

The `small` model (8 layers, bfloat16 where the CPU computes it natively, else float32; 2 torch
threads) serves in-process: real compute, with idle time before an arrival skipped
(cacheopt_serving.replay). `small` rather than `tiny`: LayerKV stages offloaded layers in free
device blocks, two for each block of one layer of each request a step stages, at most half the tier
by default, so it runs L/4 times the requests the tier holds with every layer resident: twice for 8
layers, no gain for tiny's 4. Every method gets the same device tier, sized so that it holds
DEVICE_HOLDS of the longest requests with every layer (so the baseline runs one at a time and
queues the next for blocks, LayerKV 2.2), and a cxl tier that holds them all.

Methods (engine policies):
  fcfs           prefill_admission fcfs, layer_offload none          (vLLM)
  layerkv-noslo  layer_offload layerkv: every layer or x (Eq. 4, 5), prefills first  (LayerKV without its scheduler)
  layerkv        both: and Algorithm 1's SLO-aware prefill admission

A, the context sweep (Fig. 4): prompts of CONTEXTS tokens, outputs of 128 (512 scaled by 1/4),
Poisson arrivals at one rate for every context: RATE_A times the requests per second FCFS completes
at the longest context with every request there at once (measured first, in this run: the best of
two runs; --quick, one).
B (Fig. 6-8): real instructions at RATES_B times FCFS's capacity on them: the held-out part of
instruction_trace, their prompts' lengths and the default model's own answer lengths (where the paper
uses ShareGPT; layerkv_traces).

SLOs: LayerKV 5.2.4's 3000 ms TTFT and 200 ms TPOT for Llama-2-7B on one L20, scaled by how much
slower this machine is. On the L20, a 1024-token prefill is ~13.8 TFLOP at ~60% of the 119.5
TFLOP/s dense fp16 peak, ~190 ms, and a decode step reads 13.5 GB of weights at ~80% of 864 GB/s,
~20 ms. The TTFT SLO is 3000 / 190 of this engine's 1024-token prefill and the TPOT SLO 200 / 20 of
its decode step (batch 1, 1024 tokens of context), both timed at the start of the run. A request
violates when its TTFT or its TPOT is over its SLO. Requests carry the SLOs (the TPOT SLO as the TBT
SLO) and the predicted range of their output length as serving gives it: the predictor service's
`embedding` predictor trained on the other instructions (B; A's prompts are token ids, so its history
predictor, fed A-shaped requests), Eq. 4's confidence at the run's rate, and admission's
with_predicted_lengths (layerkv_traces).

`--layer-decode` (LayerKV's engines' `layer_decode`, recorded in the config): "restore", the default,
brings a prefilled request's offloaded layers back to the device once before it decodes; "stage"
loads them into the staging area every decode step.

The prefill and offload fits (Eq. 3 and 4) are profiled once, on the first LayerKV engine, and
handed to the others (the same machine and pools: what each would measure).

Keys: mean_ttft_ratio_fcfs_vs_layerkv and throughput_ratio_layerkv_vs_fcfs at the longest context
of A (targets 10 and 0.97; throughput is output tokens per second the engine was busy: the replay
skips idle time before an arrival, and that time is not counted), violation_rate_drop (points, B,
at the first rate where FCFS violates for half its requests or more, the highest rate if none: the
load where the baseline is overloaded is the one SLO-aware admission is for, and below it both
methods meet their SLOs; target 15), and violation_rate_drop_at_<share>x at every rate of B, without
a target. The same for layerkv-noslo, without targets. Information: the device tier's tokens a layer
over the longest request of A and of B, and the predictor's error on B.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.progress import Progress

from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.policies.length.predictors import Prediction
from kvmesh.policies.offload import LayerDecode
from kvmesh.policies.views import blocks_for
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.dtypes import fastest_dtype
from kvmesh.services.engine.kv_blocks import BlockShape
from kvmesh.services.engine.native.engine import Engine
from kvmesh.services.engine.native.factory import build_engine
from kvmesh.services.engine.native.models import PRESETS
from kvmesh.services.engine.state import LayerProfile
from kvmesh.services.predictor.encoder import encoder

from .cacheopt_serving import RunStats, capacity, replay
from .instruction_trace import TraceRequest, instruction_trace
from .layerkv_traces import OUTPUT_LEN, fixed, predict, targets, trained_predictor
from .loadgen import poisson_arrivals
from .report import BenchResult, Row, save_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT = Path("bench-results/layerkv.png")
MODEL, BLOCK_SIZE, THREADS = "small", 16, 2
DTYPE = fastest_dtype("cpu")   # bfloat16 where the CPU computes it natively
CONTEXTS = (256, 512, 1024, 1536)
LONGEST = CONTEXTS[-1]
DEVICE_HOLDS = 1.5     # the device tier holds this many of the longest requests, every layer
CXL_HOLDS = 16         # the cxl tier holds this many longest requests, every layer
RATE_A = 1.0           # A's arrival rate: this share of FCFS's capacity at the longest context
RATES_B = (0.5, 1.5, 3.0, 4.5)  # B's: shares of FCFS's capacity on the instructions
B_OUTPUT_SCALE = 0.25  # B's answer lengths, scaled as A's outputs are (the paper's 512 -> 128)
CAPACITY_RUNS = 2      # FCFS's capacity is the best of this many runs (--quick: one)
# Llama-2-7B on one L20 (see the docstring), and LayerKV 5.2.4's SLOs there.
L20_PREFILL_1024_MS, L20_DECODE_STEP_MS = 190.0, 20.0
L20_TTFT_SLO_MS, L20_TPOT_SLO_MS = 3000.0, 200.0
METHODS = {"fcfs": {}, "layerkv-noslo": {"layer_offload": "layerkv"},
           "layerkv": {"layer_offload": "layerkv", "prefill_admission": "layerkv"}}


@dataclass(frozen=True)
class Metrics:
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    throughput_tok_s: float
    violation_rate: float
    layers_offloaded: int
    layers_restored: int


@dataclass(frozen=True)
class Slos:
    ttft_ms: float
    tpot_ms: float
    prefill_ms: float       # this engine's 1024-token prefill
    decode_step_ms: float   # and its decode step
    prefill_longest_ms: float  # the longest prompt's prefill, alone


def run(quick: bool, layer_decode: LayerDecode = "restore") -> BenchResult:
    torch.set_num_threads(1 if quick else THREADS)  # quick: the suite's smoke run, beside another worker
    served = sweep(quick, layer_decode)
    contexts, rates_b, slo, rate_a, capacity_b = (served.contexts, served.rates_b, served.slo, served.rate_a,
                                                  served.capacity_b)
    a, b, trace, predicted_b, profile = served.a, served.b, served.trace, served.predicted_b, served.profile
    n_a, n_b = served.n_a, served.n_b
    at = next((s for s in rates_b if b[("fcfs", s)].violation_rate >= 0.5), rates_b[-1])
    ratios = {}
    for method, suffix in (("layerkv", ""), ("layerkv-noslo", "_noslo")):
        ours, base = a[(method, LONGEST)], a[("fcfs", LONGEST)]
        ratios[f"mean_ttft_ratio_fcfs_vs_layerkv{suffix}"] = base.mean_ttft_ms / ours.mean_ttft_ms
        ratios[f"throughput_ratio_layerkv{suffix}_vs_fcfs"] = ours.throughput_tok_s / base.throughput_tok_s
        for share in rates_b:
            ratios[f"violation_rate_drop{suffix}_at_{share:g}x"] = \
                100 * (b[("fcfs", share)].violation_rate - b[(method, share)].violation_rate)
        ratios[f"violation_rate_drop{suffix}"] = ratios[f"violation_rate_drop{suffix}_at_{at:g}x"]
    device_tokens = _config("fcfs").device_blocks // PRESETS[MODEL].num_layers * BLOCK_SIZE
    ratios["device_tier_over_longest_a"] = device_tokens / (LONGEST + OUTPUT_LEN)
    ratios["device_tier_over_longest_b"] = device_tokens / max(len(r.prompt_ids) + r.output_len for r in trace)
    predictor_b = _predictor_summary(trace, predicted_b)
    ratios["predictor_mae_ratio_mean_vs_ours_b"] = predictor_b["mean_length_mae_tokens"] / predictor_b["mae_tokens"]
    # The engine's device -> cxl copies (its start-up profile, the largest size timed) against one
    # contiguous torch copy of the same bytes, and of 64 MB (out of the caches).
    copied = profile[0].copy_blocks[-1] * BlockShape(BLOCK_SIZE, PRESETS[MODEL].num_kv_heads, PRESETS[MODEL].head_dim,
                                                     getattr(torch, DTYPE)).bytes
    memcpy, memcpy_64mb = _memcpy_gbps(copied), _memcpy_gbps(64 * 2**20)
    engine_copy = float(profile[0].bandwidth_bytes_per_s) / 1e9
    ratios["copy_share_of_memcpy"] = engine_copy / memcpy
    ratios["mean_ttft_over_prefill_layerkv"] = a[("layerkv", LONGEST)].mean_ttft_ms / slo.prefill_longest_ms
    ratios["mean_ttft_over_prefill_fcfs"] = a[("fcfs", LONGEST)].mean_ttft_ms / slo.prefill_longest_ms
    targets_ = {"mean_ttft_ratio_fcfs_vs_layerkv": 10.0, "throughput_ratio_layerkv_vs_fcfs": 0.97,
                "violation_rate_drop": 15.0}
    rows = [Row(compared=f"A: {c}-token prompts, {rate_a:.2f} req/s", path=m, cells=_cells(a[(m, c)]))
            for c in contexts for m in METHODS]
    rows += [Row(compared=f"B: instructions, {s * capacity_b:.2f} req/s{' *' if s == at else ''}", path=m,
                 cells=_cells(b[(m, s)])) for s in rates_b for m in METHODS]
    return BenchResult(
        bench="layerkv", quick=quick, ratios=ratios, targets=targets_,
        ceilings={"memcpy_gbps": memcpy, "memcpy_64mb_gbps": memcpy_64mb, "engine_device_to_cxl_gbps": engine_copy,
                  "copied_bytes": float(copied), "prefill_1024_ms": slo.prefill_ms,
                  "decode_step_ms": slo.decode_step_ms, "prefill_longest_ms": slo.prefill_longest_ms},
        config={"model": MODEL, "dtype": DTYPE, "torch_threads": torch.get_num_threads(), "layer_decode": layer_decode,
                "engine": _engine_summary(layer_decode),
                "methods": METHODS, "contexts": list(contexts), "output_len": OUTPUT_LEN, "requests_a": n_a,
                "requests_b": n_b,
                "rate_a": rate_a, "capacity_b": capacity_b, "rates_b": [s * capacity_b for s in rates_b],
                "violation_rate_at": at * capacity_b, "ttft_slo_ms": slo.ttft_ms, "tpot_slo_ms": slo.tpot_ms,
                "device_tokens_per_layer": device_tokens, "b_output_scale": B_OUTPUT_SCALE, "predictor_b": predictor_b,
                "layer_profile": _profile_summary(profile[0])},
        rows=rows, plots=[_plot(a, b, contexts, rates_b, rate_a, capacity_b)],
        headline=(f"at {LONGEST}-token prompts: mean TTFT {ratios['mean_ttft_ratio_fcfs_vs_layerkv']:.2f}x lower with "
                  f"LayerKV, throughput {ratios['throughput_ratio_layerkv_vs_fcfs']:.2f}x FCFS's; real instructions at "
                  f"{at * capacity_b:.2f} req/s: {ratios['violation_rate_drop']:.0f} points fewer SLO violations"))


@dataclass
class Sweep:
    """What run() serves and measures: A at each context and B at each rate, every method; each run's
    requests and what the replay recorded of it (for bench sim_layerkv) by (method, "A <context>" or
    "B <share>x")."""

    contexts: tuple[int, ...]
    rates_b: tuple[float, ...]
    n_a: int                  # requests in each run of A
    n_b: int                  # and of B
    slo: Slos
    rate_a: float
    capacity_b: float
    trace: list[TraceRequest]
    predicted_b: dict[float, list[Prediction]]
    profile: list[LayerProfile]
    a: dict[tuple[str, int], Metrics]
    b: dict[tuple[str, float], Metrics]
    runs: dict[tuple[str, str], Run]
    layer_decode: LayerDecode  # LayerKV's engines'


def sweep(quick: bool, layer_decode: LayerDecode) -> Sweep:
    contexts = (LONGEST,) if quick else CONTEXTS
    rates_b = RATES_B[2:3] if quick else RATES_B
    n_a, n_b = (4, 12) if quick else (32, 96)
    repeats = 1 if quick else CAPACITY_RUNS
    slo = _slos(probes=1 if quick else 3)
    embed = encoder()
    a: dict[tuple[str, int], Metrics] = {}
    b: dict[tuple[str, float], Metrics] = {}
    runs: dict[tuple[str, str], Run] = {}
    profile: list[LayerProfile] = []
    with Progress(transient=True) as progress:
        served = n_a * len(contexts) + n_b * len(rates_b)
        task = progress.add_task("layerkv: capacity", total=repeats * (n_a + n_b) + len(METHODS) * served)
        advance = lambda: progress.advance(task)  # noqa: E731
        longest = fixed(n_a, LONGEST, seed=1)
        rate_a = RATE_A * _capacity(longest, advance, repeats)
        trace = instruction_trace("serve", n_b, output_scale=B_OUTPUT_SCALE, seed=2)
        b_max = max(r.output_len for r in trace)
        b_predictor = trained_predictor(instruction_trace("train", output_scale=B_OUTPUT_SCALE), embed)
        capacity_b = _capacity(trace, advance, repeats)
        for context in contexts:
            requests = longest if context == LONGEST else fixed(n_a, context, seed=1)
            a_predictor = trained_predictor(fixed(n_a, context, seed=100), embed)
            told = targets(predict(a_predictor, requests, OUTPUT_LEN, rate_a), OUTPUT_LEN, slo.ttft_ms, slo.tpot_ms)
            arrivals = poisson_arrivals(n_a, rate_a, seed=3)
            for method in METHODS:
                progress.update(task, description=f"A: {method}, {context}-token prompts at {rate_a:.2f} req/s")
                a[(method, context)], runs[(method, f"A {context}")] = \
                    _serve(method, layer_decode, requests, arrivals, told, slo, profile, advance)
        predicted_b: dict[float, list[Prediction]] = {}
        for share in rates_b:
            predicted_b[share] = predict(b_predictor, trace, b_max, share * capacity_b)
            told = targets(predicted_b[share], b_max, slo.ttft_ms, slo.tpot_ms)
            arrivals = poisson_arrivals(n_b, share * capacity_b, seed=4)
            for method in METHODS:
                progress.update(task, description=f"B: {method} at {share * capacity_b:.2f} req/s")
                b[(method, share)], runs[(method, f"B {share:g}x")] = \
                    _serve(method, layer_decode, trace, arrivals, told, slo, profile, advance)
    return Sweep(contexts, rates_b, n_a, n_b, slo, rate_a, capacity_b, trace, predicted_b, profile, a, b, runs,
                 layer_decode)


# -- engines --------------------------------------------------------------------------------------

def _config(method: str, layer_decode: LayerDecode = "restore") -> EngineConfig:
    """`method`'s engine; `layer_decode` changes nothing of FCFS's, which offloads no layer."""
    layers = PRESETS[MODEL].num_layers
    per_layer = blocks_for(LONGEST + OUTPUT_LEN, BLOCK_SIZE)  # blocks of one layer of the longest request
    return EngineConfig(model=MODEL, dtype=DTYPE, block_size=BLOCK_SIZE,
                        device_blocks=math.ceil(DEVICE_HOLDS * per_layer) * layers,
                        cxl_blocks=CXL_HOLDS * per_layer * layers, prefix_caching=False, token_budget=2048,
                        policies=METHODS[method], layer_decode=layer_decode, layer_profile="off",
                        swap_profile="off")


def method_engine(method: str, layer_decode: LayerDecode, profile: list[LayerProfile]) -> Engine:
    """An engine for `method`; LayerKV's fits from the first LayerKV engine, profiled then."""
    config = _config(method, layer_decode)
    if "layer_offload" in METHODS[method] and not profile:
        config.layer_profile = "on"
    engine = build_engine(config)
    if engine.layer_profile is not None:
        profile.append(engine.layer_profile)
    elif "layer_offload" in METHODS[method]:
        engine.layer_profile = profile[0]
        engine.blocks.use_layer_costs(profile[0].prefill_cost, profile[0].offload_cost)
    # A request with an offloaded layer runs only when that layer's whole context fits in a half of
    # the staging area: a longer one would keep every layer.
    longest = blocks_for(LONGEST + OUTPUT_LEN, BLOCK_SIZE)
    if engine.scheduler.layered and engine.scheduler.staging_cap < longest:
        raise AssertionError(f"the staging area's halves hold {engine.scheduler.staging_cap} blocks, less than one "
                             f"layer of the longest request ({longest})")
    return engine


Run = tuple[list[TraceRequest], RunStats]  # a run's requests, and what the replay recorded of it


def _serve(method: str, layer_decode: LayerDecode, requests: list[TraceRequest], arrivals: np.ndarray,
           told: list[Targets], slo: Slos, profile: list[LayerProfile],
           advance: Callable[[], None]) -> tuple[Metrics, Run]:
    engine = method_engine(method, layer_decode, profile)
    try:
        stats = replay(engine, requests, arrivals, told, max(r.output_len for r in requests), advance)
        _assert_all_blocks_free(engine, method)
    finally:
        if engine.runner.staging is not None:
            engine.runner.staging.close()
    offloaded = engine.scheduler.layers_offloaded
    return _metrics(stats, slo, offloaded["admitted"] + offloaded["forecast"], offloaded["restored"]), (requests, stats)


def _assert_all_blocks_free(engine: Engine, method: str) -> None:
    """The project's invariant: after the run every tier's free blocks are back to its total."""
    for tier, pool in engine.blocks.pools.items():
        assert pool.free_count == pool.num_blocks, \
            f"{method}: {tier} blocks leaked: {pool.free_count} of {pool.num_blocks} free"
    view = engine.blocks.pool_view()
    assert dict(view.free) == dict(view.total), f"{method}: blocks held: free {dict(view.free)} of {dict(view.total)}"


def _capacity(requests: list[TraceRequest], advance: Callable[[], None], repeats: int) -> float:
    """Requests per second FCFS completes with every request there at once (the best of `repeats`)."""
    engine = build_engine(_config("fcfs"))
    best = capacity(engine, requests, [Targets()] * len(requests), max(r.output_len for r in requests), repeats,
                    advance)
    _assert_all_blocks_free(engine, "capacity")
    return best


def _slos(probes: int) -> Slos:
    """This machine's 1024-token prefill and batch-1 decode step (medians) on the baseline's engine,
    LayerKV 5.2.4's SLOs scaled by them against the L20's; and the longest prompt's prefill alone,
    the floor under A's TTFT. `probes` runs of each."""
    engine = build_engine(_config("fcfs"))

    def prefill_then_decode(prompt_len: int, seed: int) -> tuple[float, list[float]]:
        engine.add(f"probe-{seed}", fixed(1, prompt_len, seed=seed)[0].prompt_ids,
                   SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
        started = time.perf_counter()
        engine.step()
        prefill, steps = time.perf_counter() - started, []
        while engine.scheduler.has_work():
            started = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - started)
        return prefill, steps

    prefill_then_decode(1024, seed=10)  # a warm-up
    runs = [prefill_then_decode(1024, seed=11 + i) for i in range(probes)]
    longest = [prefill_then_decode(LONGEST, seed=20 + i)[0] for i in range(probes)]
    _assert_all_blocks_free(engine, "probe")
    prefill_ms = 1e3 * float(np.median([prefill for prefill, _ in runs]))
    step_ms = 1e3 * float(np.median([step for _, steps in runs for step in steps]))
    return Slos(ttft_ms=L20_TTFT_SLO_MS * prefill_ms / L20_PREFILL_1024_MS,
                tpot_ms=L20_TPOT_SLO_MS * step_ms / L20_DECODE_STEP_MS, prefill_ms=prefill_ms, decode_step_ms=step_ms,
                prefill_longest_ms=1e3 * float(np.median(longest)))


def _memcpy_gbps(nbytes: int) -> float:
    """A ceiling for device -> cxl copies here: one contiguous torch copy of `nbytes` between two RAM tensors."""
    source = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(9):
        started = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - started)
    return source.numel() * 2 / float(np.median(seconds)) / 1e9


# -- figures --------------------------------------------------------------------------------------

def _metrics(stats: RunStats, slo: Slos, offloaded: int, restored: int) -> Metrics:
    ttft = np.array([s.ttft for s in stats.served]) * 1e3
    tpot = np.array([(s.times[-1] - s.times[0]) / max(1, len(s.times) - 1) for s in stats.served]) * 1e3
    violated = (ttft > slo.ttft_ms) | (tpot > slo.tpot_ms)
    return Metrics(mean_ttft_ms=float(ttft.mean()), p99_ttft_ms=float(np.percentile(ttft, 99)),
                   mean_tpot_ms=float(tpot.mean()),
                   throughput_tok_s=float(sum(len(s.times) for s in stats.served) / stats.busy_s),
                   violation_rate=float(violated.mean()), layers_offloaded=offloaded, layers_restored=restored)


def _predictor_summary(trace: list[TraceRequest], predicted: dict[float, list[Prediction]]) -> dict:
    """B's predictions against the true lengths: the raw prediction's and the mean length's absolute
    error, and at each rate Eq. 4's confidence and the padding it gave, in tokens."""
    actual = np.array([r.output_len for r in trace])
    raw = np.array([p.predicted for p in next(iter(predicted.values()))])
    return {"mae_tokens": float(np.abs(raw - actual).mean()),
            "mean_length_mae_tokens": float(np.abs(actual.mean() - actual).mean()),
            "mean_length_tokens": float(actual.mean()),
            "by_rate": [{"confidence": float(np.mean([p.confidence for p in ps])),
                         "mean_padding_tokens": float(np.mean([p.padding for p in ps])),
                         "estimate_mae_tokens": float(np.abs(np.array([p.estimated for p in ps]) - actual).mean())}
                        for ps in predicted.values()]}


def _cells(m: Metrics) -> dict[str, float]:
    return {"mean TTFT ms": m.mean_ttft_ms, "P99 TTFT ms": m.p99_ttft_ms, "TPOT ms": m.mean_tpot_ms,
            "tok/s": m.throughput_tok_s, "SLO violations": m.violation_rate, "layers offloaded": m.layers_offloaded,
            "restored": m.layers_restored}


def _engine_summary(layer_decode: LayerDecode) -> dict:
    config = _config("layerkv", layer_decode)
    return {k: getattr(config, k) for k in ("device_blocks", "cxl_blocks", "layer_staging_blocks", "block_size",
                                            "token_budget", "layer_free_threshold", "layer_forecast_stages",
                                            "layer_decode")}


def _profile_summary(profile: LayerProfile) -> dict:
    return {"flops_per_s": float(profile.flops_per_s), "prefill_lengths": [int(n) for n in profile.lengths],
            "prefill_s": [float(t) for t in profile.prefill_s], "copy_blocks": [int(n) for n in profile.copy_blocks],
            "copy_s": [float(t) for t in profile.copy_s],
            "alpha": float(profile.prefill_cost.alpha) if profile.prefill_cost else None,
            "beta": float(profile.offload_cost.beta) if profile.offload_cost else None}


def _plot(a, b, contexts, rates_b, rate_a, capacity_b) -> str:
    """LayerKV Fig. 4 (TTFT and throughput against the context), Fig. 6-8 (TTFT, P99 TTFT and SLO
    violations against the rate)."""
    rates = [s * capacity_b for s in rates_b]
    panels = ((a, contexts, contexts, "mean_ttft_ms", f"A: mean TTFT (ms), {rate_a:.2f} req/s", "prompt tokens"),
              (a, contexts, contexts, "throughput_tok_s", "A: throughput (output tok/s)", "prompt tokens"),
              (b, rates_b, rates, "mean_ttft_ms", "B: mean TTFT (ms)", "arrival rate (req/s)"),
              (b, rates_b, rates, "p99_ttft_ms", "B: P99 TTFT (ms)", "arrival rate (req/s)"),
              (b, rates_b, rates, "violation_rate", "B: SLO violation rate", "arrival rate (req/s)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (results, keys, xs, field, title, xlabel) in zip(axes, panels):
        for method in METHODS:
            ax.plot(xs, [getattr(results[(method, k)], field) for k in keys], marker="o", label=method)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        if "ttft" in field:
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    return save_figure(fig, PLOT)
