"""KV blocks as both backends hold them: a block's shape and bytes, and copying blocks (the first
dimension of a pool's tensor) between tensors on any devices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_RUNS = 8  # copy_block_rows: more runs than this go as one gather and scatter instead


@dataclass(frozen=True)
class BlockShape:
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        """One block: one layer's K and V for `block_size` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def blocks_in(self, capacity_bytes: int) -> int:
        return capacity_bytes // self.bytes


def copy_block_rows(source: torch.Tensor, source_blocks: Sequence[int], target: torch.Tensor,
                    target_blocks: Sequence[int]) -> None:
    """Copy rows (blocks, the first dimension) of `source` into rows of `target`, on any devices.
    Runs of blocks consecutive on both sides go as one slice copy (one memcpy or DMA, no gather);
    many runs go as one pass: a gather straight into a consecutive target (a staged layer's load),
    a scatter straight from a consecutive source (its write-back), else a gather then a scatter."""
    src, dst = np.asarray(source_blocks), np.asarray(target_blocks)
    src_runs, dst_runs = np.diff(src) != 1, np.diff(dst) != 1
    breaks = np.flatnonzero(src_runs | dst_runs) + 1
    if len(breaks) < MAX_RUNS:
        for start, end in zip([0, *breaks], [*breaks, len(src)]):
            target[dst[start]:dst[start] + end - start].copy_(source[src[start]:src[start] + end - start],
                                                              non_blocking=True)
        return
    same_device = source.device == target.device
    if same_device and not dst_runs.any():
        torch.index_select(source, 0, torch.from_numpy(src).to(source.device), out=target[dst[0]:dst[0] + len(dst)])
        return
    dst_index = torch.from_numpy(dst).to(target.device)
    if same_device and not src_runs.any():
        target.index_copy_(0, dst_index, source[src[0]:src[0] + len(src)])
        return
    src_index = torch.from_numpy(src).to(source.device)
    target.index_copy_(0, dst_index, source.index_select(0, src_index).to(target.device, non_blocking=True))
