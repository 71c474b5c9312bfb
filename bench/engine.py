"""Prefill and decode throughput of the native engine against Hugging Face transformers' `generate`
on the same checkpoint, in one run, one thread each, like for like: every ratio that carries a
target compares the two in the same dtype.

Two models: SmolLM2-135M-Instruct (the default; real weights from its GGUF file) and the `tiny`
preset (3.95M random parameters, where per-step overheads dominate). transformers runs a static
batch (every prompt the same length, so no padding is wasted on it); the engine serves the same
prompts as concurrent requests through its scheduler, paged KV and sampler. Decode tokens/s is
(batch x new tokens) over the time after the first token; prefill tokens/s is (batch x prompt
tokens) over the time to the first token. Paths take turns in each round, and each figure is its
median round, so a noisy moment on this shared VM hits them alike.

The engine's paths: float32 and bfloat16 with dense weights, and on SmolLM2 its serving
configuration, bfloat16 with the GGUF file's Q4_1/Q8_0 blocks multiplied as they ship in decode
(`4-bit decode`). The floor of a batch-1 decode step is its bytes (every weight it multiplies, and
the request's KV, read once) at the read bandwidth of a buffer that size, measured in the same run:
a decode step at batch 1 reads each weight once and does 2 FLOPs per weight byte or less.

Keys (read at batch 1 and 16; stated before the run):
- decode_tps_ratio_b{1,16}[_tiny]: the engine's bf16 over transformers' bf16 (the serving path on
  SmolLM2; dense bf16 on tiny); prefill_tps_ratio_b{1,16}[_tiny] likewise;
- decode_b1_step_over_floor: the serving path's batch-1 step over its floor (target <= 1.2);
- prefill_bf16_over_fp32: the engine's bf16 prefill tokens/s over its fp32 (target >= 1);
- rows across dtypes (transformers fp32 against the engine's bf16) are information only.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np
import torch
from rich.progress import Progress

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.model_source import DEFAULT_MODEL, resolve_model
from kvmesh.services.engine.native.factory import build_engine
from kvmesh.services.engine.native.models import save_preset_checkpoint

from .report import BenchResult, Row

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT = Path("bench-results/engine_throughput.png")
BATCHES = (1, 16)
SERVING = "kvmesh bf16 4-bit decode"
# (path, transformers dtype or None, engine settings); the engine's 4-bit path only where a GGUF is
ENGINE_PATHS = {"kvmesh fp32": {"dtype": "float32", "quantized_weights": "off"},
                "kvmesh bf16": {"dtype": "bfloat16", "quantized_weights": "off"},
                SERVING: {"dtype": "bfloat16", "quantized_weights": "on"}}
HF_PATHS = {"transformers fp32": torch.float32, "transformers bf16": torch.bfloat16}


def run(quick: bool) -> BenchResult:
    torch.set_num_threads(1)
    # (prompt tokens, new tokens); quick: a smoke run
    shapes = {"smollm2": (64, 8) if quick else (256, 64), "tiny": (32, 16) if quick else (320, 128)}
    repeats = 1 if quick else 3
    measured: dict[tuple[str, str, int], tuple[float, float]] = {}
    floors: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-engine-") as tmp, Progress(transient=True) as progress:
        save_preset_checkpoint("tiny", tmp, seed=0)
        models = {"smollm2": resolve_model(DEFAULT_MODEL).checkpoint, "tiny": Path(tmp)}
        for name, checkpoint in models.items():
            prompt_len, new_tokens = shapes[name]
            paths = {p: s for p, s in ENGINE_PATHS.items() if name == "smollm2" or p != SERVING}
            engines = {path: build_engine(EngineConfig(
                model=DEFAULT_MODEL if name == "smollm2" else str(checkpoint), token_budget=8192, max_num_seqs=64,
                device_bytes=512 * 2**20, prefix_caching=False, **settings)) for path, settings in paths.items()}
            hf = {path: _hf_model(checkpoint, dtype) for path, dtype in HF_PATHS.items()}
            timers: dict[str, Callable[[list[list[int]], int], float]] = {
                **{p: (lambda m: lambda ps, n: _time_hf(m, ps, n))(m) for p, m in hf.items()},
                **{p: (lambda e: lambda ps, n: _time_engine(e, ps, n))(e) for p, e in engines.items()}}
            task = progress.add_task(f"{name}: engine vs transformers", total=len(BATCHES) * len(timers) * (1 + 2 * repeats))
            vocab = next(iter(engines.values())).runner.model.config.vocab_size
            rng = np.random.default_rng(0)
            for batch in BATCHES:
                prompts = rng.integers(3, vocab, (batch, prompt_len)).tolist()
                for timer in timers.values():
                    timer(prompts, 2)  # warm-up
                    progress.advance(task)
                firsts: dict[str, list[float]] = {p: [] for p in timers}
                totals: dict[str, list[float]] = {p: [] for p in timers}
                for _ in range(repeats):
                    for path, timer in timers.items():
                        firsts[path].append(timer(prompts, 1))
                        progress.advance(task)
                        totals[path].append(timer(prompts, new_tokens))
                        progress.advance(task)
                for path in timers:
                    first, total = float(np.median(firsts[path])), float(np.median(totals[path]))
                    measured[(name, path, batch)] = (batch * prompt_len / first,
                                                     batch * (new_tokens - 1) / (total - first))
            serving = SERVING if SERVING in engines else "kvmesh bf16"
            floors[name] = _decode_step_floor(engines[serving], context=prompt_len + new_tokens // 2)
            del engines, hf

    def ms_b1(name: str, path: str) -> float:
        return 1e3 / measured[(name, path, 1)][1]

    rows = [Row(compared=f"{name}, batch {batch}", path=path,
                cells={"decode tok/s": decode, "ms/decode step": 1e3 * batch / decode, "prefill tok/s": prefill})
            for (name, path, batch), (prefill, decode) in measured.items()]
    rows += [Row(compared=f"{name}, batch 1", path="floor: the step's bytes at read bandwidth",
                 cells={"ms/decode step": 1e3 * floor}) for name, floor in floors.items()]
    ratios: dict[str, float] = {}
    for name, ours in (("smollm2", SERVING), ("tiny", "kvmesh bf16")):
        suffix = "" if name == "smollm2" else "_tiny"
        for batch in BATCHES:
            mine, theirs = measured[(name, ours, batch)], measured[(name, "transformers bf16", batch)]
            ratios[f"decode_tps_ratio_b{batch}{suffix}"] = mine[1] / theirs[1]
            ratios[f"prefill_tps_ratio_b{batch}{suffix}"] = mine[0] / theirs[0]
            ratios[f"decode_tps_ratio_b{batch}{suffix}_vs_transformers_fp32 (information)"] = \
                mine[1] / measured[(name, "transformers fp32", batch)][1]
    ratios["decode_b1_step_over_floor"] = ms_b1("smollm2", SERVING) / (1e3 * floors["smollm2"])
    ratios["decode_b1_dense_bf16_step_over_4bit"] = ms_b1("smollm2", "kvmesh bf16") / ms_b1("smollm2", SERVING)
    ratios["prefill_bf16_over_fp32"] = min(measured[("smollm2", "kvmesh bf16", b)][0]
                                           / measured[("smollm2", "kvmesh fp32", b)][0] for b in BATCHES)
    targets = {"decode_tps_ratio_b1": 1.0, "decode_tps_ratio_b16": 3.0, "decode_tps_ratio_b1_tiny": 1.0,
               "decode_tps_ratio_b16_tiny": 3.0, "decode_b1_step_over_floor": 1.2, "prefill_bf16_over_fp32": 1.0}
    _plot(measured)
    return BenchResult(
        bench="engine", quick=quick, ratios=ratios, targets=targets, directions={"decode_b1_step_over_floor": "<="},
        ceilings={f"decode_step_floor_ms_b1_{name}": 1e3 * floor for name, floor in floors.items()},
        config={"models": {"smollm2": f"{DEFAULT_MODEL} (GGUF Q4_1 layers, Q8_0 embedding/LM head)",
                           "tiny": "tiny preset (random init, 3.95M parameters)"},
                "prompt_len, new_tokens": shapes, "threads": 1, "batches": list(BATCHES), "repeats": repeats,
                "statistic": "median of interleaved rounds", "serving path": SERVING,
                "floor": "weights multiplied + the request's KV, once, at the read bandwidth of a buffer that size"},
        rows=rows, plots=[str(PLOT)],
        headline=f"SmolLM2 decode at batch 1: {ms_b1('smollm2', SERVING):.1f} ms a step, "
                 f"{ratios['decode_b1_step_over_floor']:.2f}x its floor (target 1.2x), "
                 f"{ratios['decode_tps_ratio_b1']:.2f}x transformers bf16; at batch 16 "
                 f"{ratios['decode_tps_ratio_b16']:.2f}x (target 3x); bf16 prefill "
                 f"{ratios['prefill_bf16_over_fp32']:.2f}x fp32")


def _hf_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _time_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
    return time.perf_counter() - start


def _time_engine(engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    while engine.scheduler.has_work():
        engine.step()
    return time.perf_counter() - start


def _decode_step_floor(engine, context: int) -> float:
    """Seconds a batch-1 decode step needs at least: the weights it multiplies (their quantised
    blocks where it serves them) and the request's KV, read once at the read bandwidth of that much data."""
    model = engine.runner.model
    weight_bytes = sum(_bytes(w) for layer in model.layers for name, w in layer.weights.items()
                       if name.endswith("_proj"))
    head = model.head if model.head is not None else model.embed_tokens if model.lm_head is None else model.lm_head
    weight_bytes += _bytes(head)
    shape = engine.blocks.device.shape
    kv_bytes = -(-context // shape.block_size) * engine.blocks.num_layers * shape.bytes
    data = torch.rand((weight_bytes + kv_bytes) // 4)  # real data: untouched memory reads as one zero page
    bandwidth = data.numel() * 4 / min(_seconds(data.sum) for _ in range(10))
    return (weight_bytes + kv_bytes) / bandwidth


def _bytes(weight) -> int:
    packed = getattr(weight, "packed", None)
    return packed.nbytes if packed is not None else weight.numel() * weight.element_size()


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _plot(measured: dict[tuple[str, str, int], tuple[float, float]]) -> None:
    names = list(dict.fromkeys(name for name, _, _ in measured))
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        paths = list(dict.fromkeys(p for n, p, _ in measured if n == name))
        width = 0.8 / len(paths)
        for ax, index, title in ((axes[row][0], 1, "decode tokens/s"), (axes[row][1], 0, "prefill tokens/s")):
            x = np.arange(len(BATCHES))
            for i, path in enumerate(paths):
                ax.bar(x + (i - (len(paths) - 1) / 2) * width, [measured[(name, path, b)][index] for b in BATCHES],
                       width, label=path)
            ax.set_xticks(x, [f"batch {b}" for b in BATCHES])
            ax.set_title(f"{name}: {title}")
            ax.set_yscale("log")
            ax.grid(True, axis="y", alpha=0.3)
        axes[row][0].legend(fontsize=7)
    fig.suptitle("native engine vs transformers generate (1 thread)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)
