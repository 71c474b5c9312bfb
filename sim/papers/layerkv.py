"""LayerKV (seeds/003, section 5) at its own scale: one vLLM 0.5.5 engine on L20 48GB GPUs, LayerKV's
layer-wise offload to host memory and its SLO-aware admission (Algorithm 1) against vLLM's FCFS with
every layer on the device.

Deployments (sim/hardware.py, section 5.1): Llama-2-7B on one L20 (TP1), Yi-34B-200K on two (TP2),
Llama-3.1-70B on four (TP4); each two GPUs share one PCIe Gen4 connection to the host, whose 2,048 GB
for eight GPUs are the cxl tier (HOST_GIB_PER_GPU each).

Methods (engine policies, sim/engine.py runs the native engine's scheduler over them):
  vllm           prefill_admission fcfs, layer_offload none, every layer on the device
  layerkv        prefill_admission layerkv (Algorithm 1), layer_offload layerkv (Eq. 4, 5, restores)
  layerkv-noslo  prefill_admission fcfs, layer_offload layerkv (section 5.2.4's ablation)
LayerKV's engine has kvmesh's defaults (docs/layerkv.md): a staging area of at most a quarter of the
device tier a layer (layer_staging_blocks' half the tier, in two halves), Eq. 5's threshold 10% of the
device tier over 8 stages; Eq. 3 and 4's fits from the deployment (sim/layer_fits.py).

Experiments:
  A (Fig. 4, and Fig. 1's workload): fixed prompts of CONTEXTS tokens and 512-token answers, Poisson
    arrivals at 1 req/s, on each model; mean TTFT against the context, and throughput.
  B (Fig. 6-8): ShareGPT-like lengths on Llama-2-7B at RATES; mean and P99 TTFT, SLO violations
    (TTFT 3,000 ms or TPOT 200 ms, section 5.2.4), throughput; LayerKV without Algorithm 1 beside.
Every request carries the SLOs (Algorithm 1 reads the TPOT one as its TBT SLO) and the predicted range
of a predictor that is exact: its lower bound (Eq. 1's N_future) and median (Eq. 5) the real output.

Assumptions the paper leaves open: the engine runs vLLM 0.5.5's default of no chunked prefill (whole
prompts a step), 256 sequences, blocks of 16; A's contexts (Fig. 1's 128 to 16K, the figures' axes
are not in the text); ShareGPT's lengths: log-normal of the means vLLM's paper gives for it (prompts
161, answers 338 tokens), sigma 1, cut to Llama-2's 4,096-token window; rates of 2 to 8 req/s
(section 5.2.4 names 5.5 and 6). Varied: the device's KV capacity halved (section 2.2: vLLM's profile
run for a long max_model_len takes activation memory from the KV blocks), the tier's bandwidth four
times the PCIe link's (what a prefill's offload and a decode's restore copy), and no predicted range
(Eq. 1's N_future then 1, the most conservative). A prefilled request's offloaded layers come back
to the device once before it decodes (the scheduler's decode_offloaded "restore", LayerKV's default)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..engine import EngineSpec, SimEngine
from ..hardware import Deployment, load_deployment
from ..layer_fits import layer_fits, with_layerkv
from ..link import KVGeometry
from ..metrics import slo_attainment, summarise
from ..simulate import simulate as simulate_engine
from ..step_cost import StepCost
from ..topology import Topology
from ..workload import Lengths
from . import sweep
from .contract import Headline
from .sweep import Outcome, Point

PROFILE = "llama-2-7b-l20-fp16-tp1"
MODELS = {"llama-2-7b": PROFILE, "yi-34b-200k": "yi-34b-200k-l20-bf16-tp2",
          "llama-3.1-70b": "llama-3.1-70b-l20-bf16-tp4"}
TITLE = "LayerKV at its scale: LayerKV against vLLM (FCFS, every layer on the device)"
CONTEXTS, QUICK_CONTEXTS = (1024, 2048, 4096, 8192, 16384), (2048, 8192)
ANSWER = 512                                # A's output tokens (Fig. 1)
CONTEXT_RATE = 1.0                          # A's arrivals, req/s (section 5.2.1)
RATES, QUICK_RATES = (2.0, 4.0, 5.0, 5.5, 6.0, 7.0, 8.0), (6.0,)  # B's, req/s
REQUESTS, QUICK_REQUESTS = 100, 6           # A's a point (Fig. 1: 100 requests); B's are SHAREGPT_SCALE times
SHAREGPT_SCALE = 5                          # B's arrivals are 2 to 8 times A's: its points run as long
SHAREGPT = (161, 338)                       # mean prompt and answer (vLLM's paper, ShareGPT)
SHAREGPT_WINDOW = 4096                      # Llama-2's context
SLO_MS = (3000.0, 200.0)                    # TTFT and TPOT (section 5.2.4)
HOST_GIB_PER_GPU = 2048 / 8                 # the server's host memory over its eight GPUs (section 5.1)
CAPACITY_SCALE, BANDWIDTH_SCALE = 0.5, 4.0  # the variations
VLLM, LAYERKV, NOSLO = "vllm", "layerkv", "layerkv-noslo"
POLICIES = {VLLM: (), LAYERKV: (("prefill_admission", "layerkv"), ("layer_offload", "layerkv")),
            NOSLO: (("layer_offload", "layerkv"),)}
PANELS = (("ttft_mean_s", "mean TTFT (s)", 1.0), ("ttft_p99_s", "P99 TTFT (s)", 1.0),
          ("slo_violation", "SLO violations (%)", 100.0), ("throughput_tok_s", "throughput (tokens/s)", 1.0))


@dataclass(frozen=True, slots=True)
class LayerKVPoint(Point):
    policies: tuple[tuple[str, str], ...] = ()
    profile: str = PROFILE


def points(deployment: Deployment, rates: Sequence[float], requests: int, seed: int, quick: bool) -> list[Point]:
    """A on every model (--quick: Llama-2-7B at QUICK_CONTEXTS), B at the rates on `deployment`; unless
    quick, vLLM and LayerKV under each variation at A's longest context and B's rates from 5 req/s."""
    models = {"llama-2-7b": deployment.name} if quick else MODELS | {"llama-2-7b": deployment.name}
    contexts = QUICK_CONTEXTS if quick else CONTEXTS

    def context(series: str, model: str, n: int, variant: str = "") -> LayerKVPoint:
        return _point(series, model, models[model], CONTEXT_RATE, Lengths("fixed", n), Lengths("fixed", ANSWER),
                      requests, seed, n + ANSWER, variant)

    def sharegpt(series: str, rate: float, variant: str = "") -> LayerKVPoint:
        return _point(series, "sharegpt", deployment.name, rate, Lengths("lognormal", SHAREGPT[0], sigma=1.0),
                      Lengths("lognormal", SHAREGPT[1], sigma=1.0), requests * SHAREGPT_SCALE, seed, SHAREGPT_WINDOW,
                      variant)

    own = [context(series, model, n) for model in models for n in contexts for series in (VLLM, LAYERKV)] + \
        [sharegpt(series, rate) for rate in rates for series in (VLLM, LAYERKV, NOSLO)]
    if quick:
        return own
    return own + [point for variant in VARIANTS for point in
                  [context(series, model, contexts[-1], variant) for model in models for series in (VLLM, LAYERKV)] +
                  [sharegpt(series, rate, variant) for rate in rates if rate >= 5 for series in (VLLM, LAYERKV)]]


VARIANTS = (f"kv capacity x{CAPACITY_SCALE:g}", f"tier bandwidth x{BANDWIDTH_SCALE:g}", "no predicted range")


def _point(series: str, workload: str, profile: str, rate: float, prompt: Lengths, output: Lengths, requests: int,
           seed: int, max_context: int, variant: str) -> LayerKVPoint:
    spec = engine_spec(load_deployment(profile), series != VLLM, variant)
    return LayerKVPoint(series, workload, rate, Topology.parse("colocated:1"), prompt, output, spec, requests, seed,
                        max_context, variant=variant, policies=POLICIES[series], profile=profile)


def engine_spec(deployment: Deployment, layerkv: bool, variant: str = "") -> EngineSpec:
    """vLLM 0.5.5's engine on the deployment: whole prompts a step; with `layerkv`, the host's memory
    as the cxl tier, a staging area and Eq. 3 and 4's fits. The variant's KV capacity or tier."""
    spec = deployment.engine_spec(block_size=16, max_num_seqs=256, token_budget=max(CONTEXTS) + ANSWER)
    if variant == VARIANTS[0]:
        spec = replace(spec, device_blocks=int(spec.device_blocks * CAPACITY_SCALE))
    if not layerkv:
        return spec
    geometry, tier = deployment.geometry, deployment.tier
    scale = BANDWIDTH_SCALE if variant == VARIANTS[1] else 1.0
    host = int(HOST_GIB_PER_GPU * deployment.tp * 2**30 // geometry.block_bytes(spec.block_size))
    prefill, offload = layer_fits(deployment)
    spec = replace(spec, cxl_blocks=host, block_bytes=geometry.block_bytes(spec.block_size),
                   swap_in_bytes_per_s=tier.to_device_gbs * 1e9 * scale,
                   swap_out_bytes_per_s=tier.from_device_gbs * 1e9 * scale)
    return with_layerkv(spec, prefill, replace(offload, bandwidth_bytes_per_s=offload.bandwidth_bytes_per_s * scale))


def simulate(point: LayerKVPoint, cost: StepCost, geometry: KVGeometry) -> Outcome:
    """One engine of the point's model with its policies; the sweep's figures, P99 TTFT and the SLO
    violations (TTFT or TPOT over SLO_MS)."""
    workload = sweep.requests(point)
    for request in workload:
        request.ttft_slo_ms, request.tbt_slo_ms = SLO_MS
        if point.variant != VARIANTS[2]:  # the predictor's range, exact
            request.predicted_output_low = request.predicted_output_median = request.max_tokens
    engine = SimEngine(point.spec, load_deployment(point.profile).cost, dict(point.policies))
    start = time.perf_counter()
    sim_seconds = simulate_engine(engine, workload)
    met = slo_attainment(workload, {"ttft": SLO_MS[0] / 1e3, "tpot": SLO_MS[1] / 1e3})
    done = [r.token_times[0] - r.arrival for r in workload if r.finished_at is not None]
    return Outcome(point, summarise(workload, sim_seconds, time.perf_counter() - start) | sweep.figures(workload) |
                   {"ttft_p99_s": float(np.percentile(done, 99)) if done else None, "slo_violation": 1 - met["all"],
                    "ttft_violation": 1 - met["ttft"], "tpot_violation": 1 - met["tpot"]})


def axis(point: Point) -> tuple[float, str]:
    """The plot's x: A's context, B's rate."""
    return (point.rate, "arrival rate (req/s)") if point.workload == "sharegpt" else \
        (point.prompt.low, "context length (tokens)")


def headlines(outcomes: Sequence[Outcome]) -> list[Headline]:
    return headlines_at(_index(outcomes, ""))


def headlines_at(at: dict[tuple[str, str, float], dict]) -> list[Headline]:
    """Rules, fixed before the run: A's gain is vLLM's mean TTFT over LayerKV's at the longest context,
    the largest over the models (Fig. 4: the gap widens "up to an order of magnitude"); B's gains are
    the largest over the rates of vLLM's mean and P99 TTFT over LayerKV's (Fig. 6 and 7: "up to 69x"
    and 45x); the violation drop is the largest over the rates of vLLM's violation rate less LayerKV's,
    in points (Fig. 8: 17.7 to 28.7)."""
    longest = max((x for (workload, _, x) in at if workload != "sharegpt"), default=None)
    models = sorted({workload for (workload, _, _) in at if workload != "sharegpt"})
    rates = sorted({x for (workload, _, x) in at if workload == "sharegpt"})
    return [
        Headline("ttft_gain_longest_context", "mean TTFT, vLLM over LayerKV, longest context (Fig. 4)", 10.0,
                 _largest([_ratio(at, model, longest, "ttft_mean_s") for model in models]), "x"),
        Headline("ttft_gain_sharegpt", "mean TTFT, vLLM over LayerKV, ShareGPT, largest over rates (Fig. 6)", 69.0,
                 _largest([_ratio(at, "sharegpt", rate, "ttft_mean_s") for rate in rates]), "x"),
        Headline("p99_ttft_gain_sharegpt", "P99 TTFT, vLLM over LayerKV, ShareGPT, largest over rates (Fig. 7)",
                 45.0, _largest([_ratio(at, "sharegpt", rate, "ttft_p99_s") for rate in rates]), "x"),
        Headline("slo_violation_drop", "SLO violation rate, vLLM less LayerKV, largest over rates (Fig. 8)", 0.287,
                 _largest([_less(at, "sharegpt", rate, LAYERKV) for rate in rates]), "%")]


def also(outcomes: Sequence[Outcome]) -> dict[str, float | None]:
    """Without a target: LayerKV's throughput over vLLM's at A's longest context per model and at B's
    highest rate (the paper: nearly identical, the gap under 3%); the violation drop of LayerKV without
    Algorithm 1 at each rate (section 5.2.4: at 5.5 req/s occasionally worse than vLLM); each method's
    TPOT violations at B's highest rate."""
    at = _index(outcomes, "")
    longest = max((x for (workload, _, x) in at if workload != "sharegpt"), default=None)
    rates = sorted({x for (workload, _, x) in at if workload == "sharegpt"})
    found = {f"sim_throughput_ratio_{model}": _inverse(_ratio(at, model, longest, "throughput_tok_s"))
             for model in sorted({w for (w, _, _) in at if w != "sharegpt"})}
    if rates:
        found["sim_throughput_ratio_sharegpt"] = _inverse(_ratio(at, "sharegpt", rates[-1], "throughput_tok_s"))
        found |= {f"sim_noslo_violation_drop_at_{rate:g}": _less(at, "sharegpt", rate, NOSLO) for rate in rates}
        found |= {f"sim_tpot_violation_{series}": at.get(("sharegpt", series, rates[-1]), {}).get("tpot_violation")
                  for series in (VLLM, LAYERKV, NOSLO)}
    return found


def variations(outcomes: Sequence[Outcome]) -> dict[str, list[Headline]]:
    """The headlines each variation has points for, beside the experiment's own."""
    own = _index(outcomes, "")
    return {"the experiment's": headlines_at(own)} | {
        variant: [h for h in headlines_at(_index(outcomes, variant)) if h.simulated is not None]
        for variant in dict.fromkeys(o.point.variant for o in outcomes) if variant}


def _index(outcomes: Sequence[Outcome], variant: str) -> dict[tuple[str, str, float], dict]:
    """(workload, series, x) -> figures: x is A's context or B's rate."""
    return {(o.point.workload, o.point.series, axis(o.point)[0]): o.figures for o in outcomes
            if o.point.variant == variant}


def _ratio(at: dict, workload: str, x: float | None, figure: str) -> float | None:
    """vLLM's figure over LayerKV's; None if either is missing or LayerKV's is 0."""
    vllm, ours = at.get((workload, VLLM, x), {}).get(figure), at.get((workload, LAYERKV, x), {}).get(figure)
    return None if vllm is None or not ours else vllm / ours


def _less(at: dict, workload: str, x: float, series: str) -> float | None:
    vllm, ours = at.get((workload, VLLM, x), {}).get("slo_violation"), at.get((workload, series, x), {}).get(
        "slo_violation")
    return None if vllm is None or ours is None else vllm - ours


def _largest(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _inverse(ratio: float | None) -> float | None:
    return None if not ratio else 1 / ratio
