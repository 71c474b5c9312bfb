"""Copying KV blocks between pools: BlockManager's default `copy`, and its copy-on-write."""

from __future__ import annotations

import torch

from ..kv_blocks import copy_block_rows
from .attention.block_copy import copy_rows
from .kv_pool import KVPool


def copy_blocks(source: KVPool, source_blocks: list[int], target: KVPool, target_blocks: list[int]) -> None:
    """Copy blocks between pools (GPU<->CXL DMA when the pools are on different devices): whole
    blocks, but of a sparsified block (CaR III-D) only the slots that hold KV; masks follow."""
    if not source_blocks:
        return
    if source.sparse.keys().isdisjoint(source_blocks):
        _copy_whole(source, source_blocks, target_blocks, target=target)
    else:
        dense = [b not in source.sparse for b in source_blocks]
        for copy, wanted in ((_copy_whole, True), (_copy_present, False)):
            pairs = [(s, t) for s, t, d in zip(source_blocks, target_blocks, dense) if d == wanted]
            if pairs:
                copy(source, [s for s, _ in pairs], [t for _, t in pairs], target=target)
    if target.valid is not None:
        target.take_masks(source, source_blocks, target_blocks)


def _copy_present(source: KVPool, source_blocks: list[int], target_blocks: list[int], *, target: KVPool) -> None:
    """Copy the K and V rows of the slots that hold KV, in one gather and scatter."""
    block_size = source.shape.block_size
    blocks = torch.tensor(source_blocks, device=source.valid.device)
    present = source.valid[blocks]   # [n, block_size]
    offsets = torch.arange(block_size, device=present.device)
    # In a pool viewed as rows of [Hkv, D], a slot's K row is 2 * block_size * block + offset; V is block_size on.
    src = (blocks[:, None] * (2 * block_size) + offsets)[present]
    dst = (torch.tensor(target_blocks, device=present.device)[:, None] * (2 * block_size) + offsets)[present]
    src, dst = src.to(source.tensor.device), dst.to(target.tensor.device)
    rows, target_rows = source.tensor.view(-1, *source.tensor.shape[3:]), target.tensor.view(-1, *target.tensor.shape[3:])
    for shift in (0, block_size):
        target_rows.index_copy_(0, dst + shift, rows.index_select(0, src + shift).to(target_rows.device))


def _copy_whole(source: KVPool, source_blocks: list[int], target_blocks: list[int], *, target: KVPool) -> None:
    if not copy_rows(source.tensor, source_blocks, target.tensor, target_blocks):
        copy_block_rows(source.tensor, source_blocks, target.tensor, target_blocks)
