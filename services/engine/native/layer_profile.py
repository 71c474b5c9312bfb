"""LayerKV's start-up profile: the terms of Eq. 3 (prefill time) and Eq. 4 (offload time) measured
on this engine's own model and pools, once, before the engine loop starts.

- FLOPS: a matmul in the model's dtype on its device; n_param and n_hidden from the model.
- alpha: least squares through the origin of prefills timed at a few lengths against Eq. 3's
  theoretical times.
- The device -> cxl bandwidth: blocks copied between the pools at a few sizes, bytes over seconds
  of the largest; beta: least squares of those copies' times against Eq. 4's (so it absorbs what a
  copy costs beyond its bytes).

Every block it borrows is free again afterwards, and nothing enters the prefix cache.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.offload import offload_time_s
from kvmesh.policies.prefill_admission import prefill_time_s
from kvmesh.policies.views import blocks_for

from ..state import LayerProfile
from ..timing import fit_through_origin, measure_flops, median_seconds
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .pool_copy import copy_blocks
from .swap_profile import filler, prefill_in_chunks

log = logging.getLogger(__name__)


def profile_layerkv(runner: ModelRunner, blocks: BlockManager, token_budget: int, lengths: Sequence[int],
                    repeats: int) -> LayerProfile:
    device = runner.device
    dtype = next(runner.model.parameters()).dtype
    flops = measure_flops(device, dtype, repeats)
    spec = runner.model.config
    params = sum(p.numel() for p in runner.model.parameters())
    prefill_s = []
    for length in lengths:
        request = filler(blocks, length)
        try:
            prefill_s.append(median_seconds(repeats, device, lambda: prefill_in_chunks(runner, request, token_budget)))
        finally:
            blocks.release(request)
    theory = PrefillCost(alpha=1.0, num_params=params, hidden_size=spec.hidden_size, flops_per_s=flops)
    alpha = fit_through_origin([prefill_time_s(n, theory) for n in lengths], prefill_s)
    prefill = dataclasses.replace(theory, alpha=alpha) if alpha else None

    sizes, copy_s = (_copy_sizes(blocks, max(lengths)) if "cxl" in blocks.pools else []), []  # nowhere to offload to
    for n in sizes:
        copy_s.append(_time_copy(blocks, n, repeats))
    block_bytes = blocks.device.shape.bytes
    bandwidth = sizes[-1] * block_bytes / copy_s[-1] if sizes and copy_s[-1] > 0 else 0.0
    offload = None
    if bandwidth > 0:
        shape = blocks.device.shape
        unit = OffloadCost(beta=1.0, num_layers=blocks.num_layers, head_dim=shape.head_dim,
                           num_kv_heads=shape.num_kv_heads, bytes_per_element=torch.finfo(shape.dtype).bits // 8,
                           bandwidth_bytes_per_s=bandwidth)
        # A copy of n blocks moves n * block_size tokens of one layer: Eq. 4 with one layer offloaded.
        beta = fit_through_origin([offload_time_s(n * shape.block_size, 1, unit) for n in sizes], copy_s)
        offload = dataclasses.replace(unit, beta=beta) if beta else None
    return LayerProfile(flops_per_s=flops, lengths=list(lengths), prefill_s=prefill_s, copy_blocks=sizes,
                        copy_s=copy_s, bandwidth_bytes_per_s=bandwidth, prefill_cost=prefill, offload_cost=offload)


def _copy_sizes(blocks: BlockManager, longest: int) -> list[int]:
    """Block counts to copy: from one to one layer of the longest profiled prompt, within both pools."""
    most = min(blocks_for(longest, blocks.block_size), blocks.device.free_count, blocks.pools["cxl"].free_count)
    return sorted({max(1, int(round(n))) for n in np.geomspace(1, max(1, most), 4)})


def _time_copy(blocks: BlockManager, n: int, repeats: int) -> float:
    device, cxl = blocks.device, blocks.pools["cxl"]
    source, target = [], []
    try:
        source = device.allocate(n)
        target = cxl.allocate(n)
        return median_seconds(repeats, device.tensor.device, lambda: copy_blocks(device, source, cxl, target))
    finally:
        for pool, taken in ((device, source), (cxl, target)):
            for block in taken:
                pool.decref(block)
                pool.release(block)


