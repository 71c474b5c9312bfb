"""Prefill and decode throughput of the native engine against Hugging Face transformers' `generate`
on the same checkpoint, in one run, one thread each.

transformers runs a static batch (every prompt the same length, so no padding is wasted on it);
the engine serves the same prompts as concurrent requests through its scheduler, paged KV and
sampler. Decode tokens/s is (batch x new tokens) over the time after the first token; prefill
tokens/s is (batch x prompt tokens) over the time to the first token. The ceiling is what memory
bandwidth allows a decode step (weights plus KV read once per step), measured in the same run.
Keys: decode_tps_ratio_b1, decode_tps_ratio_b16, prefill_tps_ratio_b1 (ours over transformers).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.progress import Progress

from kvmesh.services.engine.factory import EngineConfig, build_engine
from kvmesh.services.engine.models import save_preset_checkpoint
from kvmesh.services.engine.sampling import SamplingParams

from .report import BenchResult, Row

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT = Path("bench-results/engine_throughput.png")
BATCHES = (1, 16)


def run(quick: bool) -> BenchResult:
    torch.set_num_threads(1)
    prompt_len, new_tokens = (64, 32) if quick else (320, 128)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-engine-") as tmp, Progress(transient=True) as progress:
        task = progress.add_task("engine vs transformers", total=4 * len(BATCHES))
        save_preset_checkpoint("tiny", tmp, seed=0)
        hf = _hf_model(tmp)
        engine = build_engine(EngineConfig(model=tmp, token_budget=4096, max_num_seqs=64,
                                           device_bytes=512 * 2**20, prefix_caching=False))
        measured: dict[tuple[str, int], tuple[float, float]] = {}
        for batch in BATCHES:
            prompts = rng.integers(3, engine.runner.model.config.vocab_size, (batch, prompt_len)).tolist()
            for name, timer in (("transformers", lambda p, n: _time_hf(hf, p, n)),
                                ("kvmesh", lambda p, n: _time_engine(engine, p, n))):
                timer(prompts, 2)  # warm-up
                progress.advance(task)
                first, total = timer(prompts, 1)[0], timer(prompts, new_tokens)[0]
                measured[(name, batch)] = (batch * prompt_len / first, batch * (new_tokens - 1) / (total - first))
                progress.advance(task)
        ceiling = _decode_ceiling(engine, prompt_len + new_tokens // 2)

    rows = [Row(compared=f"batch {batch}", path=name,
                cells={"decode tok/s": measured[(name, batch)][1], "ms/decode step": 1e3 * batch / measured[(name, batch)][1],
                       "prefill tok/s": measured[(name, batch)][0]})
            for batch in BATCHES for name in ("transformers", "kvmesh")]
    rows.append(Row(compared="batch 16", path="ceiling: weights + KV read once per step",
                    cells={"decode tok/s": 16 * ceiling, "ms/decode step": 1e3 / ceiling}))
    ours, theirs = {b: measured[("kvmesh", b)] for b in BATCHES}, {b: measured[("transformers", b)] for b in BATCHES}
    ratios = {"decode_tps_ratio_b1": ours[1][1] / theirs[1][1], "decode_tps_ratio_b16": ours[16][1] / theirs[16][1],
              "prefill_tps_ratio_b1": ours[1][0] / theirs[1][0], "prefill_tps_ratio_b16": ours[16][0] / theirs[16][0],
              "decode_b16_share_of_ceiling": ours[16][1] / (16 * ceiling)}
    targets = {"decode_tps_ratio_b16": 3.0, "decode_tps_ratio_b1": 1.0}
    _plot(measured)
    return BenchResult(
        bench="engine", quick=quick, ratios=ratios, targets=targets,
        meets={k: ratios[k] >= v for k, v in targets.items()},
        ceilings={"decode_steps_per_s_membw": ceiling},
        config={"model": "tiny preset (random init)", "prompt_len": prompt_len, "new_tokens": new_tokens,
                "threads": 1, "dtype": "float32", "batches": list(BATCHES)},
        rows=rows, plots=[str(PLOT)],
        headline=f"decode at batch 16: {ratios['decode_tps_ratio_b16']:.2f}x transformers (target 3x); "
                 f"at batch 1: {ratios['decode_tps_ratio_b1']:.2f}x (target 1x)")


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _time_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
    return (time.perf_counter() - start,)


def _time_engine(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    while engine.scheduler.has_work():
        engine.step()
    return (time.perf_counter() - start,)


def _decode_ceiling(engine, context: int) -> float:
    """Decode steps per second if a step did nothing but read the weights and 16 requests' KV once."""
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = engine.blocks.device.shape
    kv_bytes = 16 * -(-context // shape.block_size) * engine.blocks.num_layers * shape.bytes
    big = torch.empty(64 * 2**20, dtype=torch.uint8)
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        big.clone()
        copies.append(time.perf_counter() - start)
    read_bandwidth = 2 * big.numel() / min(copies)  # a copy reads and writes every byte
    return read_bandwidth / (weight_bytes + kv_bytes)


def _plot(measured: dict[tuple[str, int], tuple[float, float]]) -> None:
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, index, title in ((axes[0], 1, "decode tokens/s"), (axes[1], 0, "prefill tokens/s")):
        x = np.arange(len(BATCHES))
        for offset, name in ((-0.2, "transformers"), (0.2, "kvmesh")):
            ax.bar(x + offset, [measured[(name, b)][index] for b in BATCHES], 0.4, label=name)
        ax.set_xticks(x, [f"batch {b}" for b in BATCHES])
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("native engine vs transformers generate (tiny Llama, 1 thread)")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)
