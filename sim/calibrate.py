"""`kvmesh sim calibrate`: time the native engine's steps at a handful of batch shapes, in process,
fit the step cost to them, time its swaps to and from its cxl tier at a few sizes and fit their
bandwidth (tier_copies.py), and write the profile. The one part of sim/ that imports the engine.
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
from kvmesh.policies.views import blocks_for
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.native.engine import Engine
from kvmesh.services.engine.native.factory import build_engine
from kvmesh.services.engine.native.request import Request
from kvmesh.services.engine.native.swap_profile import filler

from .fit import Row, describe, fit_copy_rate, fit_step_cost
from .step_cost import TERMS, profile_path, write_profile
from .tier_copies import DIRECTIONS, tier_entry

BATCHES = (1, 4, 16)          # requests prefilled together, then decoding together
PROMPTS = (32, 128, 384)      # their prompt length: the decodes' context
DECODE_STEPS = 8              # decode steps timed after each prefill
REPEATS = 5                   # each shape's time is the median of its repeats
TOKEN_RANGE = (10, 1000)      # prompt token ids, inside every model's vocabulary and past its special tokens
SWAP_TOKENS = (16, 64, 256, 1024, 4096)  # a swapped request's tokens: one block to a long context


def run(model: str, dtype: str, threads: int, out: Path | None, seed: int = 0) -> int:
    engine = calibrated_engine(model, dtype, threads)
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
    about = {"model": model, "dtype": _dtype(engine), "device": engine.runner.device.type, "threads": threads,
             "hardware": f"{platform.machine()}, {_cpu_name()}", "torch": torch.__version__,
             "shapes": {"batches": BATCHES, "prompts": PROMPTS, "decode_steps": DECODE_STEPS, "repeats": REPEATS}}
    write_profile(path, cost, {term: origin for term in TERMS}, about | {"tier": swap_rates(engine)}, fit)
    print(f"{describe(cost, fit, 'shapes')}; wrote {path}")
    return 0


def calibrated_engine(model: str, dtype: str, threads: int) -> Engine:
    """The engine calibrate times: sized for its largest batch, no prefix cache, the default cxl tier."""
    torch.set_num_threads(threads)
    return build_engine(EngineConfig(model=model, dtype=dtype, token_budget=max(BATCHES) * max(PROMPTS),
                                     max_num_seqs=max(BATCHES), prefix_caching=False, torch_threads=threads))


def swap_rates(engine: Engine) -> dict:
    """The profile's `tier` section: each direction's bandwidth and fixed cost, fitted to the median
    of REPEATS swaps of a request of each of SWAP_TOKENS, as the engine's scheduler swaps one
    (BlockManager.swap_out and swap_in: every layer's blocks, copied with the engine's block copy)."""
    blocks = engine.blocks
    if "cxl" not in blocks.pools:
        raise ValueError("calibrate: the engine has no cxl tier to time swaps to")
    block_bytes = blocks.pools["device"].shape.bytes * blocks.num_layers  # a block of every layer
    timings: dict[str, list[float]] = {direction: [] for direction in DIRECTIONS}
    sizes = []
    room = min(blocks.free(tier) for tier in ("device", "cxl")) // blocks.num_layers
    for tokens in tqdm([t for t in SWAP_TOKENS if blocks_for(t, blocks.block_size) <= room],
                       desc="calibrate: timing swaps", unit="size"):
        request = filler(blocks, tokens)
        try:
            _swap(engine, request)  # warm-up: the first copy into fresh blocks touches their pages
            medians = zip(*[_swap(engine, request) for _ in range(REPEATS)])
            for direction, seconds in zip(DIRECTIONS, medians):
                timings[direction].append(statistics.median(seconds))
            sizes.append(request.blocks_per_layer * block_bytes)
        finally:
            blocks.release(request)
    fitted = {direction: fit_copy_rate(sizes, seconds) for direction, seconds in timings.items()}
    for direction, (rate, fit) in fitted.items():
        print(f"{direction} ({DIRECTIONS[direction]}): {rate.bytes_per_s / 1e9:.2f} GB/s + {rate.fixed_s * 1e6:.1f} us "
              f"a swap; mean relative error {fit['mean_relative_error']:.1%} over {fit['samples']} sizes")
    about = f"the engine's cxl pool on {blocks.pools['cxl'].tensor.device.type}, its device pool on " \
            f"{engine.runner.device.type}: a swap copies a request's KV blocks of every layer between them"
    origin = f"least-squares fit (relative error) to the median of {REPEATS} swaps of requests of " \
             f"{', '.join(map(str, SWAP_TOKENS))} tokens by the native engine's BlockManager (kvmesh sim calibrate)"
    return tier_entry(fitted, about, origin)


def _swap(engine: Engine, request: Request) -> tuple[float, float]:
    """One swap of `request` out and back in: the seconds of each."""
    blocks, device = engine.blocks, engine.runner.device
    times = [time.perf_counter()]
    for move in (blocks.swap_out, blocks.swap_in):
        if not move(request):
            raise ValueError(f"calibrate: the tiers cannot hold a swap of {request.num_tokens} tokens")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter())
    return times[1] - times[0], times[2] - times[1]


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
