"""CaR (seeds/002, Sec. IV) at its own scale: OPT-13B on one A100-40GB with a CXL tier, TTFT with KV reuse
across the turns of conversations against recomputing every prompt and against a device-only LRU prefix
cache, over history length. The paper: "CaR can reduce TTFT by about 30%, especially in long context
scenarios, where TTFT of OPT-13B is reduced by more than 60%" (Abstract, IV.A, Fig. 5).

Series, each one engine with vLLM's scheduler shape (whole prompts a step up to OPT's 2,048-token window,
256 sequences, blocks of 16, recompute on preemption):
- recompute: no prefix cache (vLLM of the paper's time);
- lru: the prefix cache on the device only, LRU eviction;
- car: CaR, its cxl tier of nodes (as large as every conversation's KV: the paper's 10 TB of CXL), score
  eviction, the Shuffled Window of 8 and the prefetcher, reloads pipelined layer by layer; its copies
  to and from the cxl tier on one link each way (sim/cache_links.py), a turn waiting for a prefetch
  still in flight.

The workload (the paper gives none; sim/conversations.py): conversations start at RATE / TURNS a second,
each opens with a context of the history length and has TURNS turns of MESSAGE new tokens and OUTPUT
answered ones, THINK_S apart (exponential). The figures, fixed before the run, are the TTFT of the turns
that have a history (every turn but a conversation's first): the first turns are the same cold prefill
in every series. Headlines: the reduction of their mean TTFT against recompute, the mean over the
history lengths (the "about 30%") and at the longest (the "more than 60%": a lower bound, held to 60%).

Assumptions varied (each a point set of its own, the headlines under it): the CXL link's bandwidth (the
profile's 25 GB/s is an assumption: CaR does not give it), reloads not pipelined (waited for before the
step), both at once (a slow link and no pipelining, as Fig. 5's reload reads), CaR without its window
and prefetcher (FCFS admission), twice the rate, a shorter think time (fewer conversations alive at
once, so the device alone holds more of them), longer messages (less of each prompt reused), and
Fig. 5's setting: lone requests (LONE_RATE) whose every node is reloaded from the cxl tier (the
high-water mark at 0: idle nodes all move out), pipelined or not, at 25 or 8 GB/s."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..conversations import Conversations, conversations, turn
from ..engine import SimEngine
from ..hardware import Deployment
from ..link import KVGeometry
from ..metrics import summarise
from ..simulate import simulate as simulate_engine
from ..step_cost import StepCost
from ..topology import Topology
from ..workload import Lengths
from . import sweep
from .contract import Headline
from .sweep import Outcome, Point

PROFILE = "opt-13b-a100-40g-fp16-tp1"
TITLE = "CaR at its scale: OPT-13B, A100-40GB and a CXL tier"
MAX_CONTEXT = 2048                      # OPT's context window
HISTORIES, QUICK_HISTORIES = (256, 512, 1024, 1536, 1792), (512, 1792)
TURNS, MESSAGE, OUTPUT, THINK_S = 4, 32, 32, 30.0  # 1792 + 3 x (32 + 32) + 32 + 32 = 2048
RATES, QUICK_RATES = (1.0,), (1.0,)     # requests a second to the engine
REQUESTS, QUICK_REQUESTS = 400, 40
CXL_GBS = (12.5, 64.0)                  # the link's variations: half the profile's, CXL 3.0's (CaR Sec. I)
SLOW_GBS = 8.0                          # a slow link, with reloads not pipelined: Fig. 5's reload, as it reads
SHORT_THINK_S = 5.0
LONE = (("", None, True), (", not pipelined", None, False), (f", not pipelined at {SLOW_GBS:g} GB/s", SLOW_GBS, False))
LONG_MESSAGE = 128                      # a turn's new tokens, the variation: less of each prompt reused
LONE_RATE = 0.02                        # Fig. 5's setting: one request at a time, every node reloaded from CXL
PANELS = (("ttft_history_mean_s", "mean TTFT, turns with history (s)", 1.0),
          ("ttft_history_p90_s", "P90 TTFT, turns with history (s)", 1.0),
          ("cached_share", "share of their prompt tokens from the cache", 1.0))
RECOMPUTE, LRU, CAR = "recompute", "lru", "car"
SERIES = {RECOMPUTE: (False, False, ()), LRU: (True, False, (("cache_policy", "lru"),)),
          CAR: (True, True, (("cache_policy", "car"), ("prefill_admission", "car")))}


@dataclass(frozen=True, slots=True)
class CarPoint(Point):
    history: int = 0
    think_s: float = THINK_S
    message: int = MESSAGE
    policies: tuple[tuple[str, str], ...] = ()


def axis(point: CarPoint) -> tuple[float, str]:
    return point.history, "history length (tokens)"


def points(deployment: Deployment, rates: Sequence[float], requests: int, seed: int, quick: bool) -> list[Point]:
    """Each series at each history length and rate; unless quick, under each variation too."""
    histories = QUICK_HISTORIES if quick else HISTORIES
    own = [_point(deployment, name, history, rate, requests, seed) for rate in rates for history in histories
           for name in SERIES]
    if quick:
        return own
    at = [(history, rate) for rate in rates for history in histories]
    return own + \
        [_point(deployment, CAR, *x, requests, seed, f"cxl at {gbs:g} GB/s", gbs=gbs) for gbs in CXL_GBS
         for x in at] + \
        [_point(deployment, CAR, *x, requests, seed, "reloads not pipelined", overlap=False) for x in at] + \
        [_point(deployment, CAR, *x, requests, seed, f"reloads not pipelined, cxl at {SLOW_GBS:g} GB/s",
                gbs=SLOW_GBS, overlap=False) for x in at] + \
        [_point(deployment, CAR, *x, requests, seed, "car without window and prefetch", fcfs=True) for x in at] + \
        [_point(deployment, name, history, LONE_RATE, requests, seed, f"lone requests, from cxl{how}", gbs=gbs,
                overlap=overlap, high_water=0.0) for history in histories for name in (RECOMPUTE, CAR)
         for how, gbs, overlap in LONE] + \
        [_point(deployment, name, history, 2 * rate, requests, seed, "twice the rate") for history, rate in at
         for name in SERIES] + \
        [_point(deployment, name, *x, requests, seed, f"think time {SHORT_THINK_S:g} s", think_s=SHORT_THINK_S)
         for x in at for name in SERIES] + \
        [_point(deployment, name, *x, requests, seed, f"messages of {LONG_MESSAGE} tokens", message=LONG_MESSAGE)
         for x in at for name in SERIES]


def _point(deployment: Deployment, name: str, history: int, rate: float, requests: int, seed: int,
           variant: str = "", gbs: float | None = None, overlap: bool = True, fcfs: bool = False,
           think_s: float = THINK_S, message: int = MESSAGE, high_water: float = 0.9) -> CarPoint:
    caching, cxl, policies = SERIES[name]
    # The cxl tier holds every conversation's KV at its longest (the paper's 10 TB of CXL disks).
    cxl_blocks = requests * (MAX_CONTEXT // 16) * deployment.geometry.num_layers if cxl else 0
    spec = deployment.engine_spec(block_size=16, cxl_blocks=cxl_blocks, max_num_seqs=256, token_budget=MAX_CONTEXT,
                                  prefix_caching=caching, cache_cxl=cxl, reload_overlap=overlap,
                                  cache_high_water=high_water)
    if gbs is not None:
        spec = replace(spec, swap_in_bytes_per_s=gbs * 1e9, swap_out_bytes_per_s=gbs * 1e9)
    if fcfs:
        policies = tuple((hook, "fcfs" if hook == "prefill_admission" else policy) for hook, policy in policies)
    return CarPoint(name, "chat", rate, Topology.parse("colocated:1"), Lengths("fixed", history),
                    Lengths("fixed", OUTPUT), spec, requests, seed, MAX_CONTEXT, variant=variant, history=history,
                    think_s=think_s, message=message, policies=policies)


def workload(point: CarPoint) -> list:
    shape = Conversations(point.rate / TURNS, TURNS, point.history, Lengths("fixed", point.message),
                          Lengths("fixed", OUTPUT), point.think_s, MAX_CONTEXT)
    return conversations(shape, point.requests, point.spec.block_size, point.seed)


def simulate(point: CarPoint, cost: StepCost, geometry: KVGeometry) -> Outcome:
    """One engine with the point's policies over its conversations; the sweep's figures and CaR's."""
    requests = workload(point)
    engine = SimEngine(point.spec, cost, dict(point.policies))
    start = time.perf_counter()
    sim_seconds = simulate_engine(engine, requests)
    return Outcome(point, summarise(requests, sim_seconds, time.perf_counter() - start) | sweep.figures(requests) |
                   figures(requests, engine))


def figures(requests: Sequence, engine: SimEngine) -> dict:
    """Of the turns with a history: TTFT mean and P90, the share of their prompt tokens the cache gave;
    of the engine: prompt blocks found cached on the device and in the cxl tier, nodes reloaded."""
    later = [r for r in requests if turn(r) > 0 and r.finished_at is not None]
    ttft = [r.token_times[0] - r.arrival for r in later]
    blocks = engine.blocks
    hits = getattr(blocks, "hit_blocks", {})
    return {"ttft_history_mean_s": float(np.mean(ttft)) if ttft else None,
            "ttft_history_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
            "cached_share": sum(r.num_cached for r in later) / max(1, sum(r.prompt_len for r in later)),
            "hit_blocks_device": hits.get("device", 0), "hit_blocks_cxl": hits.get("cxl", 0),
            "prefetched_nodes": engine.scheduler.reuse.prefetched if engine.scheduler.reuse is not None else 0}


def headlines(outcomes: Sequence[Outcome]) -> list[Headline]:
    return headlines_at(_index(outcomes, ""))


def headlines_at(at: dict[tuple[str, int, float], dict]) -> list[Headline]:
    """From the figures of (series, history length, rate), None where a point is missing; at each
    history length, the mean over the rates."""
    reductions = _reductions(at, CAR, RECOMPUTE)
    return [Headline("ttft_reduction", "TTFT with reuse vs recomputation, mean over history lengths (Abstract)",
                     0.30, _mean(reductions), "%"),
            Headline("ttft_reduction_long_context", "TTFT with reuse vs recomputation, OPT-13B, longest history "
                     "(IV.A, Fig. 5: 'more than 60%')", 0.60, reductions[-1] if reductions else None, "%")]


def also(outcomes: Sequence[Outcome]) -> dict[str, float | None]:
    """Without a target (the paper gives no figure for them): CaR against the device-only LRU cache and
    the LRU cache against recomputation, the mean over history lengths and at the longest; the share of
    the history turns' prompt tokens each cache gave at the longest history."""
    at = _index(outcomes, "")
    longest = max((history for _, history, _ in at), default=None)
    found: dict[str, float | None] = {}
    for key, series, baseline in (("car_vs_lru", CAR, LRU), ("lru_vs_recompute", LRU, RECOMPUTE)):
        values = _reductions(at, series, baseline)
        found[f"sim_ttft_reduction_{key}"] = _mean(values)
        found[f"sim_ttft_reduction_{key}_longest"] = values[-1] if values else None
    for series in (LRU, CAR):
        found[f"sim_cached_share_{series}_longest"] = _mean(
            [figures.get("cached_share") for (name, history, _), figures in at.items()
             if name == series and history == longest]) if longest is not None else None
    return found


def variations(outcomes: Sequence[Outcome]) -> dict[str, list[Headline]]:
    """The headlines under each variation; one that varies CaR alone is held against the experiment's
    own recompute."""
    own = _index(outcomes, "")
    varied = {"the experiment's": own}
    for variant in dict.fromkeys(o.point.variant for o in outcomes if o.point.variant):
        at = _index(outcomes, variant)
        varied[variant] = at if any(series == RECOMPUTE for series, _, _ in at) else own | at
    return {name: headlines_at(at) for name, at in varied.items()}


def _index(outcomes: Sequence[Outcome], variant: str) -> dict[tuple[str, int, float], dict]:
    return {(o.point.series, o.point.history, o.point.rate): o.figures for o in outcomes if o.point.variant == variant}


def _reductions(at: dict, series: str, baseline: str) -> list[float | None]:
    """By history length, shortest first: 1 - series' mean TTFT of the history turns over the
    baseline's, the mean over the rates; None where a point is missing."""
    rates = sorted({rate for _, _, rate in at})
    return [_mean([_less(at, series, baseline, history, rate) for rate in rates])
            for history in sorted({history for _, history, _ in at})]


def _less(at: dict, series: str, baseline: str, history: int, rate: float) -> float | None:
    top = at.get((series, history, rate), {}).get("ttft_history_mean_s")
    bottom = at.get((baseline, history, rate), {}).get("ttft_history_mean_s")
    return None if top is None or not bottom else 1 - top / bottom


def _mean(values: Sequence[float | None]) -> float | None:
    return None if not values or None in values else float(np.mean(values))
