"""CaR (issue 9) against recomputing and against a device-only LRU prefix cache, in one run.

The `small` model (8 layers, bfloat16 where the CPU computes it natively, else float32; 2 torch
threads) serves in-process: real compute, real KV copies between the tiers. Clients are
closed-loop: each conversation sends its next turn as soon as its last answer is complete, all
conversations at once, so the engine always holds them all and the device tier sees their whole
working set.

Methods (engine settings):
  recompute     prefix_caching off: every prompt computed whole
  lru           a device-only prefix cache, LRU eviction (vLLM's and SGLang's default)
  car           two tiers: nodes the device evicts move to cxl and come back on a hit; score eviction
  car+prefetch  and CaR's scheduler: priority classes, the Shuffled Window, fetch(t) prefetch

Workloads (car_workloads):
  multi-turn     CONVERSATIONS conversations of TURNS turns; the device tier holds DEVICE_SHARE of
                 their final working set (prompt and answers), the cxl tier all of it
  system-prompt  REQUESTS requests over SYSTEM_PROMPTS system prompts of SYSTEM_LEN tokens, 4 clients;
                 the device tier holds about 1.5 system prompts beside the running requests
And CaR Fig. 5: the TTFT of a prompt of S tokens computed whole, against the same prompt with its
KV reloaded from the cxl tier, and found on the device, on an idle engine. And CaR III-D: the
multi-turn workload again on a model whose attention is as sparse as a trained one's
(car_sparsify.py), car+prefetch against car+prefetch+sparsify (profiled keep ratios within the
default quality bound): bytes copied per reloaded node, TTFT, the profile's quality cost, and how
many answer tokens match the dense run's.

Keys: ttft_reduction_vs_recompute, 1 - mean TTFT of car+prefetch / recompute over the multi-turn
turns with the longest histories (the last half; target 0.3); ttft_ratio_lru_vs_car, mean TTFT of
lru / car+prefetch on the multi-turn workload (target 1: lower than the device-only cache once the
working set exceeds the device); hit_ratio_device and hit_ratio_cxl, prompt blocks found in each
tier over blocks looked up (car+prefetch, multi-turn).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.progress import Progress

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.policies.views import blocks_for
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.dtypes import fastest_dtype
from kvmesh.services.engine.native.engine import Engine
from kvmesh.services.engine.native.factory import build_engine
from kvmesh.services.engine.native.models import PRESETS
from kvmesh.services.engine.native.request import Request
from kvmesh.services.engine.state import SparsityProfile
from kvmesh.services.engine.steps import StepLog

from . import car_sparsify
from .car_workloads import ANSWER_LEN, USER, Conversation, conversations, final_context, system_prompt_requests
from .report import BenchResult, Row, save_figure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT = Path("bench-results/car.png")
MODEL, BLOCK_SIZE, THREADS = "small", 16, 2
DTYPE = fastest_dtype("cpu")   # bfloat16 where the CPU computes it natively
CONVERSATIONS, TURNS = 8, 8
DEVICE_SHARE = 1 / 3
SYSTEM_PROMPTS, SYSTEM_LEN, REQUESTS, CLIENTS = 6, 512, 96, 4
FIG5_LENGTHS = (256, 512, 1024, 2048)
METHODS = {"recompute": dict(prefix_caching=False),
           "lru": dict(),
           "car": dict(prefix_cache_cxl=True, policies={"cache_policy": "car"}),
           "car+prefetch": dict(prefix_cache_cxl=True, policies={"cache_policy": "car", "prefill_admission": "car"})}
SPARSIFY = {**METHODS["car+prefetch"], "prefix_cache_sparsify": True, "sparsify_quality_bound": car_sparsify.BOUND}
ANSWER = SamplingParams(max_tokens=ANSWER_LEN, temperature=0.0, ignore_eos=True)


@dataclass
class Outcome:
    ttft_s: list[float] = field(default_factory=list)
    history: list[int] = field(default_factory=list)   # tokens of history each turn's prompt had
    hit_device: float = 0.0
    hit_cxl: float = 0.0
    reloaded_bytes: float = 0.0
    reloaded_nodes: int = 0
    prefetched: int = 0
    answers: dict[str, list[int]] = field(default_factory=dict)   # by request id
    profile: SparsityProfile | None = None
    # What the simulator replays (bench/sim_car.py): the engine's requests in the order sent, its steps timed.
    requests: list[Request] = field(default_factory=list)
    steps: StepLog = field(default_factory=lambda: StepLog(capacity=None))

    def cells(self) -> dict[str, float]:
        ttft = np.array(self.ttft_s) * 1e3
        return {"mean TTFT ms": float(ttft.mean()), "P90 TTFT ms": float(np.percentile(ttft, 90)),
                "hit device": self.hit_device, "hit cxl": self.hit_cxl, "MB reloaded": self.reloaded_bytes / 1e6,
                "prefetched": self.prefetched}


def run(quick: bool) -> BenchResult:
    torch.set_num_threads(1 if quick else THREADS)  # quick: the suite's smoke run, beside another worker
    n_conv, turns, n_sys = (3, 4, 24) if quick else (CONVERSATIONS, TURNS, REQUESTS)
    talks = conversations(n_conv, turns, seed=1)
    system = system_prompt_requests(n_sys, SYSTEM_PROMPTS, SYSTEM_LEN, seed=2)
    lengths = FIG5_LENGTHS[:2] if quick else FIG5_LENGTHS
    multi, shared = {}, {}
    with Progress(transient=True) as progress:
        task = progress.add_task("car", total=(len(METHODS) + 2) * n_conv * turns + len(METHODS) * n_sys
                                 + 3 * len(lengths))
        advance = lambda: progress.advance(task)  # noqa: E731
        for method, settings in METHODS.items():
            progress.update(task, description=f"multi-turn: {method}")
            multi[method] = serve_multi_turn(settings, talks, advance)
            progress.update(task, description=f"system prompts: {method}")
            shared[method] = serve_system_prompts(settings, system, advance)
        progress.update(task, description="Fig. 5: recompute vs reload")
        fig5 = _fig5(lengths, advance)
        progress.update(task, description="III-D: sparsification")
        with tempfile.TemporaryDirectory() as workdir:
            sharp = str(car_sparsify.sharp_checkpoint(MODEL, Path(workdir)))
            sparse = {name: serve_multi_turn(settings, talks, advance, sharp)
                      for name, settings in (("car+prefetch", METHODS["car+prefetch"]), ("+sparsify", SPARSIFY))}
            curve = car_sparsify.quality_curve(Path(sharp), BLOCK_SIZE)
    long = lambda o: [t for t, h in zip(o.ttft_s, o.history) if h >= np.median(o.history)]  # noqa: E731
    ours, base = multi["car+prefetch"], multi["recompute"]
    ratios = {"ttft_reduction_vs_recompute": 1 - np.mean(long(ours)) / np.mean(long(base)),
              "ttft_ratio_lru_vs_car": np.mean(multi["lru"].ttft_s) / np.mean(ours.ttft_s),
              "hit_ratio_device": ours.hit_device, "hit_ratio_cxl": ours.hit_cxl,
              "ttft_ratio_lru_vs_car_system_prompts": np.mean(shared["lru"].ttft_s) / np.mean(
                  shared["car+prefetch"].ttft_s),
              "ttft_ratio_car_vs_prefetch": np.mean(multi["car"].ttft_s) / np.mean(ours.ttft_s),
              f"reload_speedup_{lengths[-1]}": fig5[lengths[-1]]["recompute"] / fig5[lengths[-1]]["reload"]}
    ratios |= _sparsify_ratios(sparse)
    ratios = {k: float(v) for k, v in ratios.items()}
    targets = {"ttft_reduction_vs_recompute": 0.3, "ttft_ratio_lru_vs_car": 1.0}
    tiers = {"multi_turn": multi_turn_tiers(talks), "system_prompts": system_prompt_tiers()}
    rows = [Row(compared=f"multi-turn: {n_conv} x {turns} turns", path=m, cells=multi[m].cells()) for m in METHODS]
    rows += [Row(compared=f"system prompts: {n_sys} requests, {SYSTEM_PROMPTS} x {SYSTEM_LEN} tokens", path=m,
                 cells=shared[m].cells()) for m in METHODS]
    rows += [Row(compared=f"Fig. 5: {s}-token prompt, idle engine", path="TTFT ms",
                 cells={k: v * 1e3 for k, v in fig5[s].items()}) for s in lengths]
    rows += [Row(compared="III-D: multi-turn, sharp-attention model", path=m, cells={
        **sparse[m].cells(), "MB a reloaded node": sparse[m].reloaded_bytes / max(1, sparse[m].reloaded_nodes) / 1e6})
        for m in sparse]
    rows += [Row(compared="III-D: quality cost of a uniform keep ratio", path=f"keep {r:.3f}",
                 cells={"nats": cost}) for r, cost in curve.items()]
    profile = sparse["+sparsify"].profile
    return BenchResult(
        bench="car", quick=quick, ratios=ratios, targets=targets,
        directions={"ttft_ratio_lru_vs_car": ">"},
        ceilings={"reload_gbps": _link_gbps(), "prefill_tokens_per_s": lengths[-1] / fig5[lengths[-1]]["recompute"]},
        config={"model": MODEL, "dtype": DTYPE, "torch_threads": torch.get_num_threads(), "block_size": BLOCK_SIZE,
                "conversations": n_conv, "turns": turns, "answer_len": ANSWER_LEN,
                "device_and_cxl_blocks_per_layer": tiers,
                "system_prompts": SYSTEM_PROMPTS, "system_len": SYSTEM_LEN, "system_requests": n_sys,
                "clients": CLIENTS, "methods": {k: {**v} for k, v in METHODS.items()},
                "sparsify": {"sharpness": car_sparsify.SHARPNESS, "sparsity": profile.sparsity,
                             "keep_ratios": profile.keep_ratios, "keep_tokens": profile.keep_tokens,
                             "quality_bound_nats": profile.quality_bound, "relaxations": profile.relaxations,
                             "engine_default_bound_nats": EngineConfig().sparsify_quality_bound}},
        rows=rows, plots=[_plot(multi, shared, fig5, lengths), car_sparsify.plot(
            profile.sparsity, profile.keep_ratios, curve,
            (float(np.mean(profile.keep_tokens)) / BLOCK_SIZE, profile.quality_cost),
            {m: float(np.mean(o.ttft_s)) * 1e3 for m, o in sparse.items()},
            {m: o.reloaded_bytes / max(1, o.reloaded_nodes) / 1e6 for m, o in sparse.items()})],
        headline=(f"multi-turn, long histories: TTFT {ratios['ttft_reduction_vs_recompute']:.0%} lower than "
                  f"recomputing; {ratios['ttft_ratio_lru_vs_car']:.2f}x lower than a device-only LRU cache; "
                  f"hits {ours.hit_device:.0%} device, {ours.hit_cxl:.0%} cxl; sparsified (III-D, "
                  f"{profile.quality_cost:.2f} nats): {ratios['sparsify_reload_bytes_ratio_dense_vs_sparse']:.1f}x "
                  "fewer bytes a reloaded node"))


# -- engines --------------------------------------------------------------------------------------

def _sparsify_ratios(sparse: dict[str, Outcome]) -> dict[str, float]:
    dense, ours = sparse["car+prefetch"], sparse["+sparsify"]
    per_node = lambda o: o.reloaded_bytes / max(1, o.reloaded_nodes)  # noqa: E731
    same = [a == b for key, answer in ours.answers.items() for a, b in zip(answer, dense.answers[key])]
    return {"sparsify_reload_bytes_ratio_dense_vs_sparse": per_node(dense) / max(1.0, per_node(ours)),
            "sparsify_ttft_ratio_dense_vs_sparse": np.mean(dense.ttft_s) / np.mean(ours.ttft_s),
            "sparsify_quality_cost_nats": ours.profile.quality_cost,
            "sparsify_answer_token_agreement": float(np.mean(same))}


def engine_config(settings: dict, device: int, cxl: int, model: str = MODEL) -> EngineConfig:
    """An engine of `settings` with `device` and `cxl` blocks a layer."""
    layers = PRESETS[MODEL].num_layers
    return EngineConfig(model=model, dtype=DTYPE, block_size=BLOCK_SIZE,
                        device_blocks=device * layers, cxl_blocks=cxl * layers, token_budget=2048,
                        swap_profile="off", layer_profile="off", car_window=4,
                        **{k: v for k, v in settings.items() if k != "policies"},
                        policies=dict(settings.get("policies", {})))


def multi_turn_tiers(talks: list[Conversation]) -> tuple[int, int]:
    """Blocks a layer: the device holds DEVICE_SHARE of the final working set (at least two of the
    longest conversations), the cxl tier all of it, twice."""
    contexts = [blocks_for(final_context(c), BLOCK_SIZE) for c in talks]
    return max(math.ceil(DEVICE_SHARE * sum(contexts)), 2 * max(contexts)), 2 * sum(contexts)


def system_prompt_tiers() -> tuple[int, int]:
    """Blocks a layer: room for every client's request and 1.5 system prompts more; the cxl tier
    holds every system prompt twice."""
    request = blocks_for(SYSTEM_LEN + USER.high + ANSWER_LEN, BLOCK_SIZE)
    prompt = blocks_for(SYSTEM_LEN, BLOCK_SIZE)
    return CLIENTS * request + math.ceil(1.5 * prompt), 2 * SYSTEM_PROMPTS * prompt


def serve_multi_turn(settings: dict, talks: list[Conversation], advance: Callable[[], None],
                     model: str = MODEL) -> Outcome:
    engine = build_engine(engine_config(settings, *multi_turn_tiers(talks), model))
    history = [[] for _ in talks]
    turn = [0] * len(talks)
    active: dict[int, object] = {}
    outcome = Outcome()

    def submit(c: int) -> None:
        prompt = history[c] + talks[c].messages[turn[c]]
        outcome.history.append(len(history[c]))
        active[c] = engine.add(f"c{c}-t{turn[c]}", prompt, ANSWER)
        outcome.requests.append(active[c])

    for c in range(len(talks)):
        submit(c)
    while active:
        _step(engine, outcome)
        for c, request in list(active.items()):
            if request.finished:
                outcome.ttft_s.append(request.output_times[0] - request.arrival)
                outcome.answers[request.request_id] = request.output_ids
                history[c] = request.prompt_ids + request.output_ids
                turn[c] += 1
                del active[c]
                advance()
                if turn[c] < len(talks[c].messages):
                    submit(c)
    return _close(engine, outcome)


def serve_system_prompts(settings: dict, prompts: list[list[int]], advance: Callable[[], None]) -> Outcome:
    engine = build_engine(engine_config(settings, *system_prompt_tiers()))
    queue, active, outcome = list(prompts), [], Outcome()
    while queue or active:
        while queue and len(active) < CLIENTS:
            active.append(engine.add(f"s{len(prompts) - len(queue)}", queue.pop(0), ANSWER))
            outcome.requests.append(active[-1])
        _step(engine, outcome)
        for request in [r for r in active if r.finished]:
            outcome.ttft_s.append(request.output_times[0] - request.arrival)
            outcome.history.append(SYSTEM_LEN)
            active.remove(request)
            advance()
    return _close(engine, outcome)


def _step(engine: Engine, outcome: Outcome) -> None:
    """One engine step, timed and recorded with its shape when it computed something."""
    started, stepped = time.perf_counter(), engine.steps
    engine.step()
    if engine.steps != stepped:
        outcome.steps.record(engine.steps, float(engine.clock()), time.perf_counter() - started, engine.last_shape)


def _close(engine: Engine, outcome: Outcome) -> Outcome:
    state = engine.state()
    looked_up = max(1, state.prefix_cache_lookup_blocks.get("device", 0))
    outcome.hit_device = state.prefix_cache_hit_blocks.get("device", 0) / looked_up
    outcome.hit_cxl = state.prefix_cache_hit_blocks.get("cxl", 0) / looked_up
    outcome.reloaded_bytes = state.prefix_cache_moved_bytes.get("device", 0)
    outcome.reloaded_nodes = state.prefix_cache_moved_nodes.get("device", 0)
    outcome.profile = state.sparsity_profile
    outcome.prefetched = engine.scheduler.reuse.prefetched
    view = engine.blocks.pool_view()
    assert view.free == view.total, f"blocks held after the run: free {dict(view.free)} of {dict(view.total)}"
    return outcome


def _fig5(lengths: tuple[int, ...], advance: Callable[[], None]) -> dict[int, dict[str, float]]:
    """TTFT of an S-token prompt on an idle engine: computed whole; its KV reloaded from the cxl
    tier (the last token recomputed, as for any fully cached prompt); found on the device (medians of 3)."""
    engine = build_engine(EngineConfig(model=MODEL, dtype=DTYPE, block_size=BLOCK_SIZE,
                                       device_blocks=8 * 2 * blocks_for(max(lengths) + 64, BLOCK_SIZE),
                                       cxl_blocks=8 * 4 * blocks_for(max(lengths) + 64, BLOCK_SIZE),
                                       prefix_cache_cxl=True, token_budget=4096, swap_profile="off",
                                       layer_profile="off"))
    rng = np.random.default_rng(5)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        request = engine.add(f"f{rng.integers(1 << 30)}", prompt, one)
        while not request.finished:
            engine.step()
        return request.output_times[0] - request.arrival

    out = {}
    for s in lengths:
        timings = {"recompute": [], "reload": [], "device hit": []}
        for _ in range(3):
            prompt = rng.integers(16, 2000, s).tolist()
            timings["recompute"].append(ttft(prompt))
            engine.blocks._evict("device", len(engine.blocks.evictable))   # its nodes to the cxl tier
            timings["reload"].append(ttft(prompt))
            timings["device hit"].append(ttft(prompt))
            engine.blocks.clear_cache()
        out[s] = {k: float(np.median(v)) for k, v in timings.items()}
        advance()
    return out


def _link_gbps() -> float:
    """The engine's cxl -> device copy rate, timed at start (what fetch(t) divides by)."""
    engine = build_engine(engine_config(METHODS["car"], 256, 256))
    return engine.scheduler.reuse.bandwidth / 1e9


# -- figures --------------------------------------------------------------------------------------

def _plot(multi, shared, fig5, lengths) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (title, results) in zip(axes[:2], (("multi-turn", multi), ("system prompts", shared))):
        names = list(results)
        means = [np.mean(results[m].ttft_s) * 1e3 for m in names]
        p90 = [np.percentile(results[m].ttft_s, 90) * 1e3 for m in names]
        x = np.arange(len(names))
        ax.bar(x - 0.2, means, 0.4, label="mean")
        ax.bar(x + 0.2, p90, 0.4, label="P90")
        ax.set_xticks(x, names, fontsize=8)
        ax.set_title(f"{title}: TTFT (ms)", fontsize=9)
    axes[0].legend(fontsize=8)
    for kind in ("recompute", "reload", "device hit"):
        axes[2].plot(lengths, [fig5[s][kind] * 1e3 for s in lengths], marker="o", label=kind)
    axes[2].set_title("CaR Fig. 5: TTFT (ms) by prompt length, idle engine", fontsize=9)
    axes[2].set_xlabel("prompt tokens")
    axes[2].legend(fontsize=8)
    return save_figure(fig, PLOT)
