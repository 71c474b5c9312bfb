"""KVDirect (seeds/001, section 5) at its own scale: 1P1D with the KV pulled over RDMA against vLLM
colocated, Mistral-Large-Instruct-2407 on a worker of 8 H100-80G (one machine of the paper's 4, TP 8),
a 400 Gbps NIC per GPU, on arXiv-like and ShareGPT-like workloads with Poisson arrivals.

Fairness (section 2.2 and 5.2.1, "the actual QPS of vLLM is divided by 2"): rates are per engine, so
at a rate r one colocated engine gets r and the 1P1D pair 2r; the same rule as 2 colocated engines at 2r
without their routing, which the variation `2 vllm engines` runs.

Assumptions (the paper gives neither): lengths are log-normal of the paper's means, their log's
standard deviation SPREAD (varied), cut to the model's context window; rates 0.1 to 0.5 per engine
(Figures 14 and 17 speak of QPS rising to 0.5). Both systems run vLLM v0.5.3's scheduler as configured
by default without chunked prefill (the paper: "the vLLM scheduler prioritizes prefill computation"):
whole prompts a step, 256 sequences, blocks of 16, recompute on preemption, latest arrival first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..link import LinkSpec
from ..topology import Topology
from ..workload import Lengths
from .contract import Headline
from .sweep import Outcome, Point

PROFILE = "mistral-large-2407-h100-bf16-tp8"
TITLE = "KVDirect at its scale: 1P1D (pull) against vLLM colocated, per-engine rate"
MAX_CONTEXT = 131_072                                    # Mistral-Large-Instruct-2407's context window
WORKLOADS = {"arxiv": (40_642, 241), "sharegpt": (20_471, 2_328)}  # mean prompt, mean response (5.1)
SPREAD, SPREADS = 0.5, (0.25, 1.0)                       # the lengths' log-normal sigma, and its variations
RATES, QUICK_RATES = (0.1, 0.2, 0.3, 0.4, 0.5), (0.1, 0.4)
REQUESTS, QUICK_REQUESTS = 200, 12
PANELS = (("e2e_p90_s", "P90 latency (s)", 1.0), ("ttft_p90_s", "P90 TTFT (s)", 1.0),
          ("tbt_p90_s", "P90 TBT (ms)", 1e3))
VLLM, KVDIRECT, PUSH, UNCOALESCED, TWO_VLLM = "vllm", "kvdirect", "kvdirect push", "kvdirect uncoalesced", \
    "2 vllm engines"


def points(deployment, rates: Sequence[float], requests: int, seed: int, quick: bool) -> list[Point]:
    """The sweep: per workload and rate, vLLM, KVDirect, KVDirect pushing and KVDirect without
    coalescing; unless quick, the variations: the lengths' spread, and 2 vLLM engines behind routing."""
    spec = deployment.engine_spec(block_size=16, max_num_seqs=256, token_budget=MAX_CONTEXT)
    link = deployment.link

    def point(series: str, workload: str, rate: float, spread: float = SPREAD, variant: str = "") -> Point:
        prompt, output = WORKLOADS[workload]
        pd = series != VLLM
        return Point(series, workload, rate, Topology.parse("pd:1:1" if pd else "colocated:2" if series == TWO_VLLM
                                                              else "colocated:1"),
                     Lengths("lognormal", prompt, sigma=spread), Lengths("lognormal", output, sigma=spread), spec,
                     requests, seed, MAX_CONTEXT, replace(link, coalescing=False) if series == UNCOALESCED else link,
                     "push" if series == PUSH else "pull", "least_loaded" if series == TWO_VLLM else "round_robin",
                     variant)

    own = [point(series, workload, rate) for workload in WORKLOADS for rate in rates
           for series in (VLLM, KVDIRECT, PUSH, UNCOALESCED)]
    if quick:
        return own
    return own + [point(series, workload, rate, spread, f"spread {spread}") for spread in SPREADS
                  for workload in WORKLOADS for rate in rates for series in (VLLM, KVDIRECT)] + \
        [point(TWO_VLLM, workload, rate, variant="2 vllm engines") for workload in WORKLOADS for rate in rates]


def headlines(outcomes: Sequence[Outcome], variant: str = "") -> list[Headline]:
    """The paper's headlines from the experiment's own points (a variation's: the latency reductions).
    Rules, fixed before the run: a reduction or a speedup is the mean over the rates of its value at
    each (P90 latency, as Figure 13 plots); vLLM's growth is its P90 at the highest rate over the
    lowest, the larger of the two workloads'; pull against push is at the highest rate, the mean of
    the two workloads'; the transfer's share is the mean over the rates (Figure 14)."""
    at = _index(outcomes, variant)
    rates = sorted({rate for (_, _, rate) in at})
    found = [Headline(f"latency_reduction_{workload}", f"P90 latency, KVDirect vs vLLM, {workload} (Fig. 13)",
                      published, _mean([_less(_ratio(at, workload, KVDIRECT, VLLM, rate)) for rate in rates]), "%")
             for workload, published in (("arxiv", 0.55), ("sharegpt", 0.24))]
    if variant:
        return found
    for name, figure, published in (("TBT", "tbt_p90_s", 2.2), ("TTFT", "ttft_p90_s", 12.3)):
        growth = [_ratio(at, workload, VLLM, VLLM, rates[-1], figure, rates[0]) for workload in WORKLOADS]
        found.append(Headline(f"vllm_{name.lower()}_growth", f"vLLM's P90 {name}, highest rate over lowest (Fig. 13)",
                              published,
                              None if None in growth or len(rates) < 2 else max(growth), "x"))
    found += [Headline(f"transfer_share_{workload}", f"KV transfer's share of latency, {workload} (Fig. 14)", published,
                       _mean([at.get((workload, KVDIRECT, rate), {}).get("transfer_share") for rate in rates]), "%")
              for workload, published in (("arxiv", 0.011), ("sharegpt", 0.005))]
    push = _mean([_ratio(at, workload, PUSH, KVDIRECT, rates[-1]) for workload in WORKLOADS])
    found.append(Headline("pull_speedup_over_push", "P90 latency, push over pull - 1, at the highest rate (Fig. 16)",
                          0.255, _gain(push), "%"))
    # Figure 17's speedups of 1.13x and 1.03x as what they add (13%, 3%): held against the ratio itself, a
    # factor of 1.5 would take 1.0, no speedup at all.
    found += [Headline(f"coalescing_speedup_{workload}", f"P90 latency, uncoalesced over coalesced - 1, {workload} "
                       f"(Fig. 17)", published,
                       _gain(_mean([_ratio(at, workload, UNCOALESCED, KVDIRECT, rate) for rate in rates])), "%")
              for workload, published in (("arxiv", 0.13), ("sharegpt", 0.03))]
    return found


def variations(outcomes: Sequence[Outcome]) -> dict[str, dict[str, float | None]]:
    """The latency reductions under each varied assumption, beside the experiment's own."""
    varied = {f"spread {SPREAD} (the experiment's)": headlines(outcomes)[:2]}
    varied |= {variant: headlines(outcomes, variant) for variant in dict.fromkeys(o.point.variant for o in outcomes)
              if variant.startswith("spread")}
    reductions = {name: {h.key: h.simulated for h in found} for name, found in varied.items()}
    both = _index(outcomes, "") | _index(outcomes, TWO_VLLM)
    rates = sorted({rate for (_, series, rate) in both if series == TWO_VLLM})
    if rates:
        reductions[TWO_VLLM] = {f"latency_reduction_{workload}": _mean(
            [_less(_ratio(both, workload, KVDIRECT, TWO_VLLM, rate)) for rate in rates]) for workload in WORKLOADS}
    return reductions


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
