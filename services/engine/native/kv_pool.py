"""A tier's KV blocks: one tensor, and an allocator with reference counts.

The tensor is `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (docs/engine.md). `device` is
the accelerator's memory, or on a CPU machine a capacity-limited RAM pool standing in for scarce
HBM; `cxl` is host memory (pinned when there is a GPU to DMA from) or a file/DAX mapping by path.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from ..kv_blocks import BlockShape


class OutOfBlocks(RuntimeError):
    pass


class KVPool:
    """`num_blocks` blocks of one tier, with their free list and reference counts."""

    def __init__(self, tier: str, num_blocks: int, shape: BlockShape, device: torch.device | str = "cpu",
                 path: str | Path | None = None):
        if num_blocks <= 0:
            raise ValueError(f"the {tier} pool needs at least one block, got {num_blocks}")
        self.tier, self.shape, self.num_blocks = tier, shape, num_blocks
        dims = (num_blocks, 2, shape.block_size, shape.num_kv_heads, shape.head_dim)
        if path is not None:
            numel = dims[0] * 2 * shape.block_size * shape.num_kv_heads * shape.head_dim
            self.tensor = torch.from_file(str(path), shared=True, size=numel, dtype=shape.dtype).view(dims)
        else:
            self.tensor = torch.zeros(dims, dtype=shape.dtype, device=device)
            if tier == "cxl" and torch.cuda.is_available():
                self.tensor = self.tensor.pin_memory()  # so GPU<->CXL copies are DMA, off the compute stream
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        # Sparsification (CaR III-D, track_tokens): which slots of each block hold KV (a dropped
        # token's slot does not), the attention each slot's token has drawn (a tier where requests
        # compute only), and the blocks with dropped slots with how many slots they keep. None and
        # empty while sparsification is off.
        self.valid: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.sparse: dict[int, int] = {}

    def track_tokens(self, scores: bool) -> None:
        """Keep a per-slot mask of present KV, and per-slot attention scores if `scores`."""
        rows = (self.tensor.shape[0], self.shape.block_size)
        self.valid = torch.ones(rows, dtype=torch.bool, device=self.tensor.device)
        self.scores = torch.zeros(rows, dtype=torch.float32, device=self.tensor.device) if scores else None

    def drop_tokens(self, blocks: list[int], keep: list[list[int]]) -> None:
        """Mark every slot of each of `blocks` but its `keep` as holding no KV."""
        size = self.shape.block_size
        mask = torch.zeros(len(blocks), size, dtype=torch.bool)
        for row, kept in enumerate(keep):
            mask[row, kept] = True
        self.valid[torch.tensor(blocks, device=self.valid.device)] = mask.to(self.valid.device)
        self.sparse.update((block, len(kept)) for block, kept in zip(blocks, keep) if len(kept) < size)

    def take_masks(self, source: KVPool, source_blocks: list[int], blocks: list[int]) -> None:
        """`blocks` now hold what `source_blocks` of `source` hold: their masks follow."""
        masked = [(src, dst) for src, dst in zip(source_blocks, blocks) if src in source.sparse]
        cleared = [dst for src, dst in zip(source_blocks, blocks) if dst in self.sparse and src not in source.sparse]
        if masked:
            index = torch.tensor([src for src, _ in masked], device=source.valid.device)
            self.valid[torch.tensor([dst for _, dst in masked], device=self.valid.device)] = \
                source.valid[index].to(self.valid.device)
            self.sparse.update((dst, source.sparse[src]) for src, dst in masked)
        if cleared:
            self.valid[torch.tensor(cleared, device=self.valid.device)] = True
            for block in cleared:
                del self.sparse[block]

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{self.tier} pool: {n} blocks asked, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        self._refs[block] += 1

    def decref(self, block: int) -> int:
        """Drop one reference; returns the count left. The caller frees (or caches) at zero."""
        self._refs[block] -= 1
        if self._refs[block] < 0:
            raise AssertionError(f"{self.tier} block {block} released more often than taken")
        return self._refs[block]

    def refs(self, block: int) -> int:
        return self._refs[block]

    def release(self, block: int) -> None:
        """Return a block with no references to the free list."""
        if self._refs[block]:
            raise AssertionError(f"{self.tier} block {block} freed while still referenced")
        if self.sparse.pop(block, None) is not None:
            self.valid[block] = True
        if self.scores is not None:
            self.scores[block] = 0
        self._free.append(block)
