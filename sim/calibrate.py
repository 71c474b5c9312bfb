"""`kvmesh sim calibrate`: time the native engine's steps at a handful of batch shapes, in process,
fit the step cost to them, and write the profile. The one part of sim/ that imports the engine.
(`--from-engine URL` fits the steps a running engine service recorded instead: served_steps.py.)"""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.native.engine import Engine
from kvmesh.services.engine.native.factory import build_engine

from .fit import Row, describe, fit_step_cost
from .step_cost import TERMS, profile_path, write_profile

BATCHES = (1, 4, 16)          # requests prefilled together, then decoding together
PROMPTS = (32, 128, 384)      # their prompt length: the decodes' context
DECODE_STEPS = 8              # decode steps timed after each prefill
REPEATS = 5                   # each shape's time is the median of its repeats
TOKEN_RANGE = (10, 1000)      # prompt token ids, inside every model's vocabulary and past its special tokens


def run(model: str, dtype: str, threads: int, out: Path | None, seed: int = 0) -> int:
    torch.set_num_threads(threads)
    engine = build_engine(EngineConfig(model=model, dtype=dtype, token_budget=max(BATCHES) * max(PROMPTS),
                                       max_num_seqs=max(BATCHES), prefix_caching=False, torch_threads=threads))
    generator = torch.Generator().manual_seed(seed)
    _scenario(engine, 1, min(PROMPTS), generator)  # warm-up: first calls set up kernels and buffers
    timings: dict[Row, list[float]] = defaultdict(list)
    scenarios = [(b, p) for b in BATCHES for p in PROMPTS] * REPEATS
    for batch, prompt in tqdm(scenarios, desc="calibrate: timing engine steps", unit="shape"):
        for shape, seconds in _scenario(engine, batch, prompt, generator):
            timings[shape].append(seconds)
    shapes = sorted(timings)
    cost, fit = fit_step_cost(shapes, [statistics.median(timings[s]) for s in shapes])
    path = out or profile_path(f"{_slug(model)}-{engine.runner.device.type}-{_dtype(engine)}-{threads}t")
    origin = f"least-squares fit to the median of {REPEATS} timings of each of {len(shapes)} step shapes of " \
             f"the native engine (kvmesh sim calibrate)"
    write_profile(path, cost, {term: origin for term in TERMS},
                  {"model": model, "dtype": _dtype(engine), "device": engine.runner.device.type, "threads": threads,
                   "hardware": f"{platform.machine()}, {_cpu_name()}",
                   "torch": torch.__version__, "shapes": {"batches": BATCHES, "prompts": PROMPTS,
                                                          "decode_steps": DECODE_STEPS, "repeats": REPEATS}},
                  fit)
    print(f"{describe(cost, fit, 'shapes')}; wrote {path}")
    return 0


def _scenario(engine: Engine, batch: int, prompt: int, generator: torch.Generator) -> list[tuple[Row, float]]:
    """`batch` prompts of `prompt` tokens prefilled in one step, then decoded DECODE_STEPS steps: each
    step's shape and staged bytes, as the engine counted what it ran (Engine.last_shape, last_staged_bytes:
    none here, so g fits 0), and its time."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(*TOKEN_RANGE, (prompt,), generator=generator).tolist()
        engine.add(f"calibrate-{engine.steps}-{i}", ids, params)
    timed = []
    while engine.scheduler.has_work():
        start = time.perf_counter()
        engine.step()
        timed.append(((*engine.last_shape, engine.last_staged_bytes), time.perf_counter() - start))
    return timed


def _dtype(engine: Engine) -> str:
    return str(next(engine.runner.model.parameters()).dtype).removeprefix("torch.")


def _slug(model: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", Path(model).name.lower()).strip("-")


def _cpu_name() -> str:
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        return "unknown cpu"
    return f"{len(names)} x {names[0]}" if names else "unknown cpu"
