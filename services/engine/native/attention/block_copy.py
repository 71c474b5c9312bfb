"""Whole-block copies between two KV pools on the CPU, one memcpy per block over torch's threads
(csrc/block_copy.cpp). torch copies the scatter half of a gather-and-scatter (index_copy_) on one
thread, at about 12 GB/s here against 70 for a gather; a staged LayerKV layer, a swap and a cxl-tier
reload all scatter into blocks the free list handed out."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .paged import _kernel


def copy_rows(source: torch.Tensor, source_rows: Sequence[int], target: torch.Tensor,
              target_rows: Sequence[int]) -> bool:
    """target[target_rows] = source[source_rows] with the C++ kernel; False, copying nothing, where
    it does not apply (a GPU, no kernel, one tensor on both sides): the caller's torch path then."""
    kernel = _kernel() if source.is_cpu and target.is_cpu else None
    if kernel is None or source.data_ptr() == target.data_ptr():
        return False
    kernel.copy_rows(source, torch.as_tensor(source_rows, dtype=torch.int64), target,
                     torch.as_tensor(target_rows, dtype=torch.int64))
    return True
