"""CaR's cxl tier on stock vLLM: kvmesh's connector keeping prefix blocks in host memory, against vLLM's
own device prefix cache alone, on multi-turn conversations a small device cannot keep.

One vLLM instance (vLLM's CPU build, the `small` preset, float32, one core) with its prefix cache on
and a KV cache of 1.5 times the longest conversation, far less than the conversations' histories
together. The conversations take turns round-robin, one request at a time, each turn's prompt the
whole conversation so far plus a new message (bench/car_workloads.py): vLLM's LRU device cache
lets a history go before its next turn comes. Setups, in one run:
  recompute  vLLM alone: a history its device cache let go is computed again
  kvmesh     the same with KVMeshConnector's cxl tier (CXL_BLOCKS slots, no data plane): every full
             block written through to host memory as it is computed, a history the device let go
             loaded back layer by layer
  device     vLLM alone with a device large enough for every history: the reuse ceiling
vLLM's own CPU offloading connectors (OffloadingConnector, SimpleCPUOffloadConnector) run on CUDA
only, so they are not compared here.

Reported for the turns after each conversation's first: mean and P90 TTFT, the share of prompt tokens
not computed; and the cxl tier's blocks loaded, saved and evicted, its reload rate against a memcpy.
Keys: ttft_ratio_recompute_vs_kvmesh (mean TTFT, target >= 1.3), ttft_over_device_kvmesh (kvmesh's
mean TTFT over the ceiling's), reload_share_of_memcpy.
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from kvmesh.services.engine.kv_blocks import BlockShape
from kvmesh.services.engine.native.models import PRESETS, save_preset_checkpoint

from .car_workloads import ANSWER_LEN, conversations, final_context
from .report import BenchResult, Row, save_figure
from .vllm import memcpy_gbps, read_answers
from .vllm_instance import BLOCK_SIZE
from .vllm_process import VllmProcess, vllm_missing

MODEL = "small"
CONVERSATIONS, TURNS = 12, 4
QUICK_CONVERSATIONS, QUICK_TURNS = 10, 3
DEVICE_HOLDS = 1.5       # the device holds this many of the longest conversation, at its last turn
CXL_BLOCKS = 512
SETUPS = ("recompute", "kvmesh", "device")
PLOT = Path("bench-results/vllm_car.png")
LOGS = Path("bench-results/vllm-logs")
STALL_S = 120.0


def run(quick: bool) -> BenchResult:
    reason = vllm_missing()
    if reason:
        raise SystemExit(f"kvmesh bench vllm_car: {reason}")
    n, turns = (QUICK_CONVERSATIONS, QUICK_TURNS) if quick else (CONVERSATIONS, TURNS)
    talks = conversations(n, turns, seed=5)
    block_bytes = _block_bytes()
    device_blocks = math.ceil(DEVICE_HOLDS * max(final_context(t) for t in talks) / BLOCK_SIZE)
    LOGS.mkdir(parents=True, exist_ok=True)
    core = str(sorted(os.sched_getaffinity(0))[0])
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch, Progress(transient=True) as progress:
        model = save_preset_checkpoint(MODEL, Path(scratch), seed=0)
        task = progress.add_task("vllm_car", total=len(SETUPS) * n * turns)
        for setup in SETUPS:
            progress.update(task, description=f"vllm_car: {setup} (starting vLLM)")
            instance = VllmProcess(
                model, "kv_both", core, LOGS / f"car-{setup}.log", connector="kvmesh" if setup == "kvmesh" else "none",
                prefix_caching=True, kv_bytes=(device_blocks if setup != "device" else n * device_blocks) * block_bytes,
                max_model_len=(device_blocks - 1) * BLOCK_SIZE,   # less vLLM's null block
                **({"handoff": False, "cxl_blocks": CXL_BLOCKS, "model": MODEL} if setup == "kvmesh" else {}))
            try:
                instance.ready()
                progress.update(task, description=f"vllm_car: {setup}")
                results[setup] = _converse(instance, talks, lambda: progress.advance(task), tier=setup == "kvmesh")
            finally:
                instance.stop()
    memcpy = memcpy_gbps()
    figures = {setup: _figures(results[setup]) for setup in SETUPS}
    tier = results["kvmesh"]["tier"]
    loaded_bytes = tier["loaded"] * tier["slot_bytes"]
    reload_gbps = loaded_bytes / max(tier["load_seconds"], 1e-9) / 1e9
    ratios = {"reload_share_of_memcpy": reload_gbps / memcpy,
              "ttft_ratio_recompute_vs_kvmesh": figures["recompute"]["mean TTFT ms"] / figures["kvmesh"]["mean TTFT ms"],
              "p90_ttft_ratio_recompute_vs_kvmesh": figures["recompute"]["P90 TTFT ms"] / figures["kvmesh"]["P90 TTFT ms"],
              "ttft_over_device_kvmesh": figures["kvmesh"]["mean TTFT ms"] / figures["device"]["mean TTFT ms"],
              "cached_share_kvmesh": figures["kvmesh"]["cached share"],
              "cached_share_recompute": figures["recompute"]["cached share"]}
    targets = {"ttft_ratio_recompute_vs_kvmesh": 1.3}
    rows = [Row(compared=f"{n} conversations x {turns} turns, {device_blocks}-block device", path=setup,
                cells=figures[setup]) for setup in SETUPS]
    return BenchResult(
        bench="vllm_car", quick=quick, ratios=ratios, targets=targets,
        ceilings={"memcpy_gbps": memcpy, "reload_gbps": reload_gbps,
                  "device_mean_ttft_ms": figures["device"]["mean TTFT ms"]},
        config={"model": MODEL, "block_size": BLOCK_SIZE, "device_blocks": device_blocks, "cxl_blocks": CXL_BLOCKS,
                "conversations": n, "turns": turns, "answer_tokens": ANSWER_LEN, "tier": tier,
                "loaded_mb": loaded_bytes / 1e6},
        rows=rows, plots=[_plot(figures)],
        headline=(f"vLLM with kvmesh's cxl tier: mean TTFT of later turns {ratios['ttft_ratio_recompute_vs_kvmesh']:.2f}x "
                  f"lower than vLLM recomputing what its device let go, {ratios['ttft_over_device_kvmesh']:.2f}x a "
                  f"device that holds every history; {tier['loaded']} blocks loaded back at {reload_gbps:.1f} GB/s "
                  f"({ratios['reload_share_of_memcpy']:.0%} of a memcpy), {tier['saved']} written through"))


def _converse(instance: VllmProcess, talks, advance, tier: bool) -> dict:
    """Round-robin turns, one request at a time. TTFT and cached prompt tokens of every turn but
    the first; then the cxl tier's counts when `tier` (asked through the same reader: it owns the
    instance's output)."""
    answers: queue.Queue = queue.Queue()
    threading.Thread(target=read_answers, args=(instance, 0, answers), daemon=True).start()
    history = [[] for _ in talks]
    ttft, cached, prompt = [], [], []
    for turn in range(len(talks[0].messages)):
        for c, talk in enumerate(talks):
            request = history[c] + talk.messages[turn]
            instance.send("add", id=f"{c}-{turn}", prompt=request, max_tokens=ANSWER_LEN)
            try:
                _, answer = answers.get(timeout=STALL_S)
            except queue.Empty:
                raise RuntimeError(f"conversation {c}, turn {turn}: no answer for {STALL_S:g} s") from None
            history[c] = request + answer["token_ids"]
            if turn:
                ttft.append(answer["token_times"][0] - answer["added"])
                cached.append(answer["cached_tokens"])
                prompt.append(len(request))
            advance()
    result = {"ttft": ttft, "cached": cached, "prompt": prompt}
    if tier:
        instance.send("tier")
        result["tier"] = answers.get(timeout=STALL_S)[1]
    return result


def _figures(result: dict) -> dict[str, float]:
    ttft = np.array(result["ttft"]) * 1e3
    return {"mean TTFT ms": float(ttft.mean()), "P90 TTFT ms": float(np.percentile(ttft, 90)),
            "cached share": sum(result["cached"]) / sum(result["prompt"])}


def _block_bytes() -> int:
    """A block of every layer of MODEL in float32, as the instance runs it."""
    spec = PRESETS[MODEL]
    return BlockShape(BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, torch.float32).bytes * spec.num_layers


def _plot(figures: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, metric in zip(axes, ("mean TTFT ms", "P90 TTFT ms")):
        ax.bar(SETUPS, [figures[s][metric] for s in SETUPS], color=["tab:gray", "tab:blue", "tab:green"])
        ax.set_title(metric + " (turns after the first)", fontsize=9)
    return save_figure(fig, PLOT)
