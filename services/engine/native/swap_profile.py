"""CacheOpt 3.5's start-up profile: at a few sequence lengths S, how long recomputing S tokens' KV
takes (a prefill of S tokens, in chunks of the token budget as the scheduler would run it) and how
long swapping it takes (out to the cxl tier and back in, every layer); `fit_curves` turns the
medians into the curves the `sweet_spot` strategy reads from `PoolView.swap_curves`.

It runs once, before the engine loop starts, on the engine's own model and pools, and leaves every
block free as it found it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import numpy as np

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.policies.costs import SwapCurves
from kvmesh.policies.iteration import ScheduledChunk
from kvmesh.policies.swap_recompute import fit_curves
from kvmesh.policies.views import blocks_for

from ..state import SwapProfile
from ..timing import median_seconds
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .request import Request

log = logging.getLogger(__name__)

DEFAULT_POINTS = 5   # lengths when none are configured: from one block to the longest, spaced geometrically


def profile_lengths(block_size: int, longest: int, points: int = DEFAULT_POINTS) -> list[int]:
    """`points` lengths spaced geometrically from one block to `longest` tokens (fewer if they round alike)."""
    return sorted({int(round(s)) for s in np.geomspace(block_size, max(longest, block_size), points)})


def profile_swap(runner: ModelRunner, blocks: BlockManager, token_budget: int, lengths: Sequence[int],
                 repeats: int) -> SwapProfile:
    """Time recompute and swap at each length (the median of `repeats`), and fit the curves."""
    recompute_s, swap_s = [], []
    for length in lengths:
        request = filler(blocks, length)
        try:
            recompute_s.append(median_seconds(repeats, runner.device,
                                              partial(prefill_in_chunks, runner, request, token_budget)))
            swap_s.append(median_seconds(repeats, runner.device, partial(_swap_out_and_in, blocks, request)))
        finally:
            blocks.release(request)
    return SwapProfile(lengths=list(lengths), recompute_s=recompute_s, swap_s=swap_s,
                       curves=_fit(lengths, recompute_s, swap_s))


def filler(blocks: BlockManager, length: int) -> Request:
    """A request of `length` tokens holding device blocks for all of them (none named for the prefix cache)."""
    request = Request("swap-profile", [0] * length, SamplingParams(max_tokens=1), 0.0, blocks.num_layers)
    if not blocks.reserve(request, blocks_for(length, blocks.block_size), length):
        raise ValueError(f"swap profile: the device tier cannot hold {length} tokens")
    return request


def prefill_in_chunks(runner: ModelRunner, request: Request, token_budget: int) -> None:
    for start in range(0, request.num_tokens, token_budget):
        request.num_computed = start
        runner.run([ScheduledChunk(request, min(token_budget, request.num_tokens - start))])


def _swap_out_and_in(blocks: BlockManager, request: Request) -> None:
    if not (blocks.swap_out(request) and blocks.swap_in(request)):
        raise ValueError(f"swap profile: the tiers cannot hold {request.num_tokens} tokens")


def _fit(lengths: Sequence[int], recompute_s: list[float], swap_s: list[float]) -> SwapCurves | None:
    try:
        return fit_curves(lengths, recompute_s, lengths, swap_s)
    except ValueError as exc:
        log.warning("swap profile: no curves fitted (%s); the sweet_spot strategy swaps as `swap` does", exc)
        return None
