"""KVDirect (seeds/001, section 5) at its own scale: 1P1D with the KV pulled over RDMA against vLLM
colocated, Mistral-Large-Instruct-2407 on a worker of 8 H100-80G (one machine of the paper's 4, TP 8),
a 400 Gbps NIC per GPU, on arXiv-like and ShareGPT-like workloads with Poisson arrivals.

Fairness (section 2.2 and 5.2.1, "the actual QPS of vLLM is divided by 2 for fair comparison"): at a
rate of r per engine one colocated engine gets r and the 1P1D pair 2r (the figures' QPS read as the
pair's, vLLM's halved). Two vLLM engines behind least-loaded routing at 2r, the other reading of the
same rule, is a variation.

Assumptions (the paper gives none of them): lengths are log-normal of the paper's means, their log's
standard deviation SPREAD, cut to the model's context window; rates of 0.05 to 0.25 per engine, the
pair at 0.1 to 0.5 (Figures 14 and 17 speak of QPS rising to 0.5). Every engine runs vLLM v0.5.3's
scheduler on whole prompts (chunked prefill off: the paper's "the vLLM scheduler prioritizes prefill
computation", and its vLLM whose TBT stops growing only when the KV runs out): a step prefills whole
prompts while decodes stall, 256 sequences, blocks of 16, recompute on preemption, latest arrival
first. vLLM v0.5.3's own default for a model of more than 32K tokens of context, chunked prefill of 512
tokens a step (CHUNK_TOKENS), is a variation. K and V of a block lie in two regions of vLLM's cache
(Figure 5), so a block of a layer is two reads. Without coalescing a read costs UNCOALESCED_READ_US (the
profile's per-read cost is 0: Figure 15's 22.23 GB/s already pays it, for coalesced reads). Varied:
SPREAD, the fairness reading, the scheduler, a fixed time added to every step (STEP_OVERHEAD_S: the
paper's TBT of 45-67 ms in Figure 12 is about twice the roofline's decode step), the decodes' attention
reading the KV at PAGED_ATTENTION_EFFICIENCY of the bandwidth (vLLM's own PagedAttention kernel as
FlashInfer measured it on H100; the profile keeps the GEMV's share, as vLLM v0.5.3 decodes with
FlashAttention-2 there), the rates (LOW_RATES, where the pair's prefill engine keeps up with arXiv; and
those with the slower steps together, the regime Figures 12 and 14 describe: decode the bottleneck), the
link (one NIC's 22.23 GB/s rather than the profile's eight, one a GPU, each moving its own KV heads; or
eight at the NICs' line rate, as Figure 15's 22.23 GB/s is an average over block sizes, 4-32 KB in
Figure 4, while a coalesced read is a layer's whole run), and pull against push at PUSH_RATES on ShareGPT, where
the decode engine's memory is full (on arXiv the prefill engine saturates first, and pushing changes
nothing)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..engine import EngineSpec
from ..hardware import Deployment
from ..link import KVGeometry
from ..roofline import Roofline
from ..topology import Topology
from ..workload import Lengths
from .contract import Headline
from . import sweep
from .sweep import Outcome, Point

PROFILE = "mistral-large-2407-h100-bf16-tp8"
TITLE = "KVDirect at its scale: 1P1D (pull) against vLLM colocated, per-engine rate"
MAX_CONTEXT = 131_072                                    # Mistral-Large-Instruct-2407's context window
WORKLOADS = {"arxiv": (40_642, 241), "sharegpt": (20_471, 2_328)}  # mean prompt, mean response (5.1)
SPREAD, SPREADS = 0.5, (0.25, 1.0)                       # the lengths' log-normal sigma, and its variations
RATES, QUICK_RATES = (0.05, 0.1, 0.15, 0.2, 0.25), (0.05, 0.2)  # per engine
REQUESTS, QUICK_REQUESTS = 200, 12
UNCOALESCED_READ_US = 1.0                                # a read's cost without coalescing (assumption)
# The step-cost variation (assumption, sized from Figure 12's TBT of 45-67 ms against the roofline's 17-28 ms):
# vLLM's v0.6.0 post measured v0.5.3's TPOT at twice v0.6.0's on Llama-70B over 4 H100 (ShareGPT, 32 QPS), the
# difference its CPU time a step (https://blog.vllm.ai/2024/09/05/perf-update.html).
STEP_OVERHEAD_S = 0.025
# vLLM v0.5.3 turns chunked prefill on when max_model_len > 32,768 and none of sliding window, speculative
# decoding, LoRA, prompt adapters or prefix caching is in use (vllm/engine/arg_utils.py, create_engine_config),
# at max_num_batched_tokens 512 (vllm/config.py, SchedulerConfig), decodes first (core/scheduler.py).
CHUNK_TOKENS = 512
CHUNKED = f"vLLM v0.5.3's default: chunked prefill, {CHUNK_TOKENS} tokens a step"
LOW_RATES = (0.02, 0.04, 0.06, 0.08, 0.1)  # per engine: below 0.14, where the pair's prefill engine saturates on arXiv
LOW = f"rates {LOW_RATES[0]:g}-{LOW_RATES[-1]:g} per engine"
LOW_SLOW = f"{LOW}, steps +{STEP_OVERHEAD_S * 1e3:g} ms"  # the regime the paper describes: decode the bottleneck
LINE_RATE_GBS = 50.0                                     # a 400 Gbps NIC (Sec. 5.1), GB/s
ONE_NIC, LINE_RATE = "the link of one NIC", f"the link at 8 NICs' line rate ({LINE_RATE_GBS:g} GB/s each)"
PAGED_ATTENTION_EFFICIENCY = 0.28  # vLLM PagedAttention-v2, H100, batch 64, GQA 8, 8K tokens (FlashInfer's Fig. 9)
PAGED_ATTENTION = f"decode attention at {PAGED_ATTENTION_EFFICIENCY:g} of HBM"
PUSH_RATES = (0.35, 0.4)  # per engine: pull against push where ShareGPT fills the decode engine's memory
PANELS = (("e2e_p90_s", "P90 latency (s)", 1.0), ("ttft_p90_s", "P90 TTFT (s)", 1.0),
          ("tbt_p90_s", "P90 TBT (ms)", 1e3))
VLLM, KVDIRECT, PUSH, UNCOALESCED, TWO_VLLM = "vllm", "kvdirect", "kvdirect push", "kvdirect uncoalesced", \
    "2 vllm engines"


def points(deployment: Deployment, rates: Sequence[float], requests: int, seed: int, quick: bool) -> list[Point]:
    """The sweep: per workload and rate, vLLM, KVDirect, KVDirect pushing and KVDirect without
    coalescing; unless quick, vLLM and KVDirect under each variation."""
    whole = deployment.engine_spec(block_size=16, max_num_seqs=256, token_budget=MAX_CONTEXT, chunked_prefill=False)
    chunked = replace(whole, chunked_prefill=True, token_budget=CHUNK_TOKENS)
    link = replace(deployment.link, kv_apart=True)
    series = {VLLM: ("colocated:1", "pull", link), KVDIRECT: ("pd:1:1", "pull", link),
              PUSH: ("pd:1:1", "push", link), TWO_VLLM: ("colocated:2", "pull", link),
              UNCOALESCED: ("pd:1:1", "pull", replace(link, coalescing=False, per_read_us=UNCOALESCED_READ_US))}

    def point(name: str, workload: str, rate: float, variant: str = "", spread: float = SPREAD,
              overhead_s: float = 0.0, link_gbs: float | None = None, spec: EngineSpec = whole) -> Point:
        (prompt, output), (topology, mode, its_link) = WORKLOADS[workload], series[name]
        if link_gbs is not None:
            its_link = replace(its_link, gbps=link_gbs)
        return Point(name, workload, rate, Topology.parse(topology), Lengths("lognormal", prompt, sigma=spread),
                     Lengths("lognormal", output, sigma=spread), spec, requests, seed, MAX_CONTEXT, its_link, mode,
                     "least_loaded" if name == TWO_VLLM else "round_robin", overhead_s, variant)

    each = [(workload, rate) for workload in WORKLOADS for rate in rates]
    own = [point(name, *at) for at in each for name in (VLLM, KVDIRECT, PUSH, UNCOALESCED)]
    if quick:
        return own
    both = (VLLM, KVDIRECT)
    return own + [point(name, *at, f"spread {spread}", spread=spread) for spread in SPREADS for at in each
                  for name in both] + \
        [point(name, *at, f"steps +{STEP_OVERHEAD_S * 1e3:g} ms", overhead_s=STEP_OVERHEAD_S) for at in each
         for name in both] + \
        [point(name, *at, PAGED_ATTENTION) for at in each for name in both] + \
        [point(name, *at, CHUNKED, spec=chunked) for at in each for name in both] + \
        [point(name, workload, rate, LOW) for workload in WORKLOADS for rate in LOW_RATES for name in both] + \
        [point(name, workload, rate, LOW_SLOW, overhead_s=STEP_OVERHEAD_S) for workload in WORKLOADS
         for rate in LOW_RATES for name in both] + \
        [point(TWO_VLLM, *at, TWO_VLLM) for at in each] + \
        [point(KVDIRECT, *at, ONE_NIC, link_gbs=deployment.link.gbps / deployment.tp) for at in each] + \
        [point(KVDIRECT, *at, LINE_RATE, link_gbs=LINE_RATE_GBS * deployment.tp) for at in each] + \
        [point(name, "sharegpt", rate, f"sharegpt at {', '.join(map(str, PUSH_RATES))} per engine")
         for rate in PUSH_RATES for name in (KVDIRECT, PUSH)]


def simulate(point: Point, cost: Roofline, geometry: KVGeometry) -> Outcome:
    """sweep.simulate's, with the paged-attention variation's decodes reading the KV at its share."""
    if point.variant == PAGED_ATTENTION:
        cost = replace(cost, gpu=replace(cost.gpu, decode_attention_efficiency=PAGED_ATTENTION_EFFICIENCY))
    return sweep.simulate(point, cost, geometry)


def headlines(outcomes: Sequence[Outcome]) -> list[Headline]:
    return headlines_at(_index(outcomes, ""))


def also(outcomes: Sequence[Outcome]) -> dict[str, float | None]:
    """Beside the headlines, without a target: the reduction of the mean latency (the paper's figures
    are of P90), the mean over the rates."""
    at = _index(outcomes, "")
    rates = sorted({rate for (_, _, rate) in at})
    return {f"sim_mean_latency_reduction_{workload}": _mean(
        [_less(_ratio(at, workload, KVDIRECT, VLLM, rate, "e2e_mean_s")) for rate in rates]) for workload in WORKLOADS}


def headlines_at(at: dict[tuple[str, str, float], dict]) -> list[Headline]:
    """The paper's headlines from the figures of (workload, series, rate), None where a point is missing.
    Rules, fixed before the run: a reduction or a speedup is the mean over the rates of its value at
    each (P90 latency, as Figure 13 plots); vLLM's growth is its P90 at the highest rate over the
    lowest, the larger of the two workloads'; pull against push is at the highest rate, the mean of
    the two workloads'; the transfer's share is the mean over the rates (Figure 14)."""
    rates = sorted({rate for (_, _, rate) in at})
    found = [Headline(f"latency_reduction_{workload}", f"P90 latency, KVDirect vs vLLM, {workload} (Fig. 13)",
                      published, _mean([_less(_ratio(at, workload, KVDIRECT, VLLM, rate)) for rate in rates]), "%")
             for workload, published in (("arxiv", 0.55), ("sharegpt", 0.24))]
    for name, figure, published in (("TBT", "tbt_p90_s", 2.2), ("TTFT", "ttft_p90_s", 12.3)):
        growth = [_ratio(at, workload, VLLM, VLLM, rates[-1], figure, rates[0]) for workload in WORKLOADS]
        found.append(Headline(f"vllm_{name.lower()}_growth", f"vLLM's P90 {name}, highest rate over lowest (Fig. 13)",
                              published,
                              None if None in growth or len(rates) < 2 else max(growth), "x"))
    found += [Headline(f"transfer_share_{workload}", f"KV transfer's share of latency, {workload} (Fig. 14)", published,
                       _mean([at.get((workload, KVDIRECT, rate), {}).get("transfer_share") for rate in rates]), "%")
              for workload, published in (("arxiv", 0.011), ("sharegpt", 0.005))]
    push = _mean([ratio for ratio in (_ratio(at, workload, PUSH, KVDIRECT, rates[-1]) for workload in WORKLOADS)
                  if ratio is not None])
    found.append(Headline("pull_speedup_over_push", "P90 latency, push over pull - 1, at the highest rate (Fig. 16)",
                          0.255, _gain(push), "%"))
    # Figure 17's speedups of 1.13x and 1.03x as what they add (13%, 3%): held against the ratio itself, a
    # factor of 1.5 would take 1.0, no speedup at all.
    found += [Headline(f"coalescing_speedup_{workload}", f"P90 latency, uncoalesced over coalesced - 1, {workload} "
                       f"(Fig. 17)", published,
                       _gain(_mean([_ratio(at, workload, UNCOALESCED, KVDIRECT, rate) for rate in rates])), "%")
              for workload, published in (("arxiv", 0.13), ("sharegpt", 0.03))]
    return found


def variations(outcomes: Sequence[Outcome]) -> dict[str, list[Headline]]:
    """The headlines each variation has points for, beside the experiment's own. Two vLLM engines stand
    in for vLLM against the experiment's own KVDirect."""
    own = _index(outcomes, "")
    varied = {"the experiment's": own} | {variant: _index(outcomes, variant) for variant in
                                          dict.fromkeys(o.point.variant for o in outcomes) if variant}
    if TWO_VLLM in varied:
        varied[TWO_VLLM] = own | {(workload, VLLM, rate): figures for (workload, _, rate), figures in
                                  varied[TWO_VLLM].items()}
    return {name: [h for h in headlines_at(at) if h.simulated is not None] if name != TWO_VLLM
            else headlines_at(at)[:2] for name, at in varied.items()}


def _index(outcomes: Sequence[Outcome], variant: str) -> dict[tuple[str, str, float], dict]:
    return {(o.point.workload, o.point.series, o.point.rate): o.figures for o in outcomes if o.point.variant == variant}


def _ratio(at: dict, workload: str, series: str, baseline: str, rate: float, figure: str = "e2e_p90_s",
           baseline_rate: float | None = None) -> float | None:
    """`series`' figure over `baseline`'s (at `baseline_rate`, the same rate unless given); None if missing."""
    top, bottom = at.get((workload, series, rate), {}).get(figure), \
        at.get((workload, baseline, rate if baseline_rate is None else baseline_rate), {}).get(figure)
    return None if top is None or bottom is None else top / bottom


def _less(ratio: float | None) -> float | None:
    """A ratio to the baseline as a reduction: 0.45 -> 0.55 (55% less)."""
    return None if ratio is None else 1 - ratio


def _gain(ratio: float | None) -> float | None:
    """A ratio to the baseline as what it adds: 1.13 -> 0.13 (13% more)."""
    return None if ratio is None else ratio - 1


def _mean(values: Sequence[float | None]) -> float | None:
    return None if not values or None in values else float(np.mean(values))
