"""Replaying an in-process run (bench/cacheopt_serving.py's replay, which bench cacheopt and bench
layerkv serve through) in the simulator, for the validation benches (issue 31 item 2): the run's
requests as it gave them, through one SimEngine configured as the engine that served it, with a
step cost, and the same run with one assumption varied at a time."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from kvmesh.policies.allocation import AllocationParams
from kvmesh.policies.views import RequestView
from kvmesh.services.engine.native.engine import Engine
from kvmesh.sim.cluster import Cluster
from kvmesh.sim.engine import HOOKS, EngineSpec, SimEngine, Step
from kvmesh.sim.fit import fit_step_cost, recorded_shape
from kvmesh.sim.prefix_count import PrefixCount
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import TERMS, StepCost

from .cacheopt_serving import RunStats, Served
from .instruction_trace import TraceRequest
from .sim_validation import (FIGURES, HELD, TARGET, TARGETED, calibration_fit, relative_error, six_term_fit,
                             step_time_ratio)

ENGINE = "engine-c0"
SENSITIVITY = 0.05  # the own-steps cost this much faster and slower: each figure's elasticity to the step cost


@dataclasses.dataclass(frozen=True)
class Configured:
    spec: EngineSpec
    policies: dict[str, str]
    allocation: AllocationParams


def configured(engine: Engine) -> Configured:
    """The simulated engine as `engine` is: its pools, block size and bytes, token budget and
    sequence limit, the policies of the hooks the simulator runs, the ledger's parameters. A copy
    between the tiers runs at what the engine measured: LayerKV's profiled device -> cxl bandwidth
    (Eq. 4's) where it has one, else half the round trip's rate its swap profile fitted (L_s's
    slope), else sim's default. With layer-wise offloading on, the staging area and Eq. 5's
    parameters are the scheduler's, and Eq. 3 and 4's fits the engine's profile. With a prefix cache,
    its settings (cached()); its requests then need their blocks' names (sim_requests)."""
    blocks, scheduler = engine.blocks, engine.scheduler
    device, cxl = blocks.pools["device"], blocks.pools.get("cxl")
    spec = EngineSpec(block_size=blocks.block_size, num_layers=blocks.num_layers, device_blocks=device.num_blocks,
                      max_num_seqs=scheduler.max_num_seqs, token_budget=scheduler.token_budget,
                      cxl_blocks=cxl.num_blocks if cxl else 0, block_bytes=device.shape.bytes,
                      **copy_rates(engine), **layered(engine), **cached(engine))
    return Configured(spec, {h: n for h, n in scheduler.policies.names.items() if h in HOOKS}, scheduler.ledger.params)


def copy_rates(engine: Engine) -> dict[str, float]:
    """The spec's copy bandwidths each way, as configured() says; none (sim's default) unmeasured."""
    layers, swap = engine.layer_profile, engine.swap_profile
    if layers is not None and layers.offload_cost is not None:
        per_s = layers.offload_cost.bandwidth_bytes_per_s
    elif swap is not None and swap.curves is not None and swap.curves.swap.g > 0:
        blocks = engine.blocks
        per_s = 2 * blocks.pools["device"].shape.bytes * blocks.num_layers / blocks.block_size / swap.curves.swap.g
    elif engine.scheduler.reuse.bandwidth > 0:  # CaR's cxl -> device rate, timed at start for its prefetcher
        per_s = engine.scheduler.reuse.bandwidth
    else:
        return {}
    return {"swap_out_bytes_per_s": per_s, "swap_in_bytes_per_s": per_s}


def layered(engine: Engine) -> dict:
    """LayerKV's settings of the spec, when the engine offloads layers (none otherwise: the
    simulator then counts blocks whole, as the native engine does with no layer offloaded)."""
    scheduler, profile = engine.scheduler, engine.layer_profile
    if not scheduler.layered:
        return {}
    fits = {} if profile is None else {"prefill_cost": profile.prefill_cost, "offload_cost": profile.offload_cost}
    return {"staging_cap": scheduler.staging_cap, "offload": scheduler.offload, **fits}


def cached(engine: Engine) -> dict:
    """The prefix cache's settings of the spec (none without one): CaR's cxl tier of nodes, its
    high-water mark and Shuffled Window."""
    blocks = engine.blocks
    if not blocks.prefix_caching:
        return {}
    return {"prefix_caching": True, "cache_cxl": blocks.cache_cxl, "cache_high_water": blocks.high_water,
            "window": engine.scheduler.reuse.params}


@dataclasses.dataclass(eq=False)
class TraceSimRequest(SimRequest):
    """A request of the trace: it ends at its trace length (`max_tokens`, where the simulator ends
    it) while the policies read the max_tokens it was sent with, the trace's longest (no policy can
    read its true length from it, as in bench cacheopt's replay)."""

    sent_max_tokens: int = 0

    def view(self) -> RequestView:
        return msgspec.structs.replace(super().view(), max_tokens=self.sent_max_tokens)


def sim_requests(stats: RunStats, requests: list[TraceRequest], sent_max_tokens: int,
                 block_names: Sequence[tuple[str, ...]] = ()) -> list[TraceSimRequest]:
    """The run's requests as it gave them: arrival, prompt and output length, SLOs, estimated length
    and predicted range; and for an engine with a prefix cache, each one's `block_names`."""
    names = block_names or [()] * len(requests)
    return [TraceSimRequest(f"r{i}", arrival, len(r.prompt_ids), r.output_len, ttft_slo_ms=t.ttft_slo_ms,
                            tbt_slo_ms=t.tbt_slo_ms, predicted_output_len=t.predicted_output_len,
                            predicted_output_low=t.predicted_output_low,
                            predicted_output_median=t.predicted_output_median, sent_max_tokens=sent_max_tokens,
                            block_names=named)
            for i, (r, arrival, t, named) in enumerate(zip(requests, stats.arrivals, stats.targets, names))]


class InlineCopies(SimEngine):
    """The simulated engine copying a staged layer's KV within its step, before and after the
    layer's compute, as the native engine on a CPU does (layer_copy_thread off): the copies add to
    the step rather than overlap it (sim/staging_time.py, a GPU's side stream)."""

    def seconds(self, step: Step) -> float:
        copies = sum(load + write for load, write in step.staged.values())
        return super().seconds(dataclasses.replace(step, staged={})) + copies


def simulated(stats: RunStats, requests: list[TraceRequest], sent_max_tokens: int, engine: Configured,
              cost: StepCost, kind: type[SimEngine] = SimEngine, block_names: Sequence[tuple[str, ...]] = (),
              cluster: Callable[[dict], Cluster] = Cluster) -> tuple[RunStats, dict]:
    """The run replayed through one simulated engine (of `kind`, in `cluster`, which may send its
    requests later than their arrivals, as a closed loop's clients): its requests' token times (an
    unfinished one has none of its last), its preemptions by strategy, the simulated seconds; and
    the simulated steps, wall seconds, unfinished requests and layers offloaded (LayerKV)."""
    replayed = sim_requests(stats, requests, sent_max_tokens, block_names)
    sim = kind(engine.spec, cost, engine.policies, engine.allocation)
    start = time.perf_counter()
    seconds = cluster({ENGINE: ("both", sim)}).run(replayed)
    wall = time.perf_counter() - start
    preemptions = {"recompute": 0, "swap": 0}
    for _, _, strategy in sim.preemptions:
        preemptions[strategy] += 1
    served = [Served(r.arrival, list(r.token_times), r.preemptions) for r in replayed]
    return (RunStats(served, preemptions, seconds, stats.arrivals, stats.targets, []),
            {"steps": sim.steps, "wall_s": wall, "unfinished": sum(r.finished_at is None for r in replayed),
             "layers_offloaded": dict(sim.scheduler.layers_offloaded), **cache_counts(sim.blocks)})


def cache_counts(blocks) -> dict:
    """A prefix cache's blocks found in each tier over blocks looked up, and its bytes copied
    between the tiers by why (prefix_count.py); none without a prefix cache."""
    if not isinstance(blocks, PrefixCount):
        return {}
    looked_up = max(1, blocks.lookup_blocks)
    return {"hit_device": blocks.hit_blocks["device"] / looked_up, "hit_cxl": blocks.hit_blocks["cxl"] / looked_up,
            "copied_bytes": dict(blocks.copied)}


@dataclasses.dataclass
class Variation:
    suffix: str     # of its keys
    label: str
    cost: StepCost
    stats: RunStats
    info: dict      # simulated steps, wall seconds, unfinished requests


def variations(stats: RunStats, requests: list[TraceRequest], sent_max_tokens: int, engine: Configured,
               calibrated: StepCost, others: Sequence[tuple[str, str, StepCost]] = (),
               block_names: Sequence[tuple[str, ...]] = (), cluster: Callable[[dict], Cluster] = Cluster
               ) -> list[Variation]:
    """The replay with the calibrated step cost, then with one assumption varied at a time: the
    calibrated cost scaled to the run's own steps' total (the machine's speed in that run, the
    calibration's shape), the run's own steps' cost (the best the cost's form reaches), each of
    `others` (suffix, label, cost), and with layer-wise offloading the staged layers' copies
    inline, not overlapped; and the run's own cost SENSITIVITY faster and slower (what a figure's
    error does with a small error in the step cost)."""
    own, _ = calibration_fit(stats.steps)
    plans = [("", "simulated", calibrated, SimEngine),
             ("_rescaled", "calibrated, rescaled to the run",
              scaled(calibrated, step_time_ratio(calibrated, stats.steps)), SimEngine),
             ("_own_steps", "the run's own steps", own, SimEngine),
             *((suffix, label, cost, SimEngine) for suffix, label, cost in others),
             *([("_inline_copies", "copies inline", calibrated, InlineCopies)] if engine.spec.staging_cap else []),
             *((f"_own_steps_x{f:g}", f"the run's own steps x {f:g}", scaled(own, f), SimEngine)
               for f in (1 - SENSITIVITY, 1 + SENSITIVITY))]
    return [Variation(suffix, label, cost,
                      *simulated(stats, requests, sent_max_tokens, engine, cost, kind, block_names, cluster))
            for suffix, label, cost, kind in plans]


def calibration_variants(steps: list[dict]) -> list[tuple[str, str, StepCost]]:
    """The calibration's steps fitted otherwise, as `others` of variations(): in relative error, and
    with the prefill-sequence term f (six terms)."""
    return [("_relative_fit", "calibration fitted in relative error", relative_fit(steps)),
            ("_with_f", "calibration with f (six terms)", six_term_fit(steps))]


def relative_fit(steps: list[dict]) -> StepCost:
    """The step cost fitted to `steps` minimising the relative error (each step counts alike), not
    the error in seconds: the short steps' shape weighs as much as the long ones'."""
    return fit_step_cost([recorded_shape(s) for s in steps], [s["seconds"] for s in steps], relative=True,
                         held=HELD)[0]


def scaled(cost: StepCost, factor: float) -> StepCost:
    return StepCost(*(factor * getattr(cost, term) for term in TERMS))


def figures(stats: RunStats) -> dict[str, float]:
    """P50 and P90 TTFT, mean TPOT (each request's first to last token over its gaps, averaged) and
    P90 end to end, in seconds, over the requests that finished (all, measured)."""
    done = [s for s in stats.served if s.times]
    ttft = [s.ttft for s in done]
    tpot = [(s.times[-1] - s.times[0]) / (len(s.times) - 1) for s in done if len(s.times) > 1]
    e2e = [s.times[-1] - s.arrival for s in done]
    if not done:
        return dict.fromkeys(FIGURES, math.nan)
    return {"p50_ttft": float(np.percentile(ttft, 50)), "p90_ttft": float(np.percentile(ttft, 90)),
            "mean_tpot": float(np.mean(tpot)) if tpot else math.nan, "p90_e2e": float(np.percentile(e2e, 90))}


def keys(name: str, real: RunStats, found: list[Variation]) -> tuple[dict[str, float], dict[str, float]]:
    """One run's keys: sim_error_<figure>_<name><suffix> of each variation (the calibrated one's,
    suffix '', targeted for TARGETED), and sim_elasticity_<figure>_<name>; and the targets."""
    measured, ratios, targets = figures(real), {}, {}
    simulated = {v.suffix: figures(v.stats) for v in found}
    low, high = (simulated[f"_own_steps_x{f:g}"] for f in (1 - SENSITIVITY, 1 + SENSITIVITY))
    for n in FIGURES:
        key = f"sim_error_{n}_{name}"
        ratios |= {f"{key}{suffix}": relative_error(values[n], measured[n]) for suffix, values in simulated.items()}
        ratios[f"sim_elasticity_{n}_{name}"] = (high[n] - low[n]) / simulated["_own_steps"][n] / (2 * SENSITIVITY)
        if n in TARGETED:
            targets[key] = TARGET
    return ratios, targets
