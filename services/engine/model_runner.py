"""Tensors in, logits out: turns a step's chunks into one flattened batch and runs the model.

Every token of every scheduled request goes into one batch (prefill chunks and decodes together).
The attention callable handed to the model writes each layer's new K/V into the request's blocks
of that layer, then attends over the blocks in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .attention import paged_attention, write_kv
from .kv_pool import KVPool
from .scheduler import ScheduledChunk


class PagedStep:
    """The attention of one step: per-layer block tables and slots, shared sequence lengths."""

    def __init__(self, pool: torch.Tensor, block_tables: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float):
        self.pool, self.block_tables, self.slots = pool, block_tables, slots
        self.seq_lens, self.query_start_loc, self.scale = seq_lens, query_start_loc, scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(self.pool, k, v, self.slots[layer])
        return paged_attention(q, self.pool, self.block_tables[layer], self.seq_lens, self.query_start_loc,
                               self.scale)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, num_layers: int, head_dim: int):
        self.model, self.pool, self.num_layers = model, pool, num_layers
        self.block_size = pool.shape.block_size
        self.scale = head_dim ** -0.5
        self.device = pool.tensor.device

    @torch.inference_mode()
    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk; logits [n, vocab] (float32) of the chunks that sample, in order."""
        lengths = [c.num_tokens for c in chunks]
        starts = [c.request.num_computed for c in chunks]
        ids = [t for c, s, n in zip(chunks, starts, lengths) for t in c.request.all_ids[s:s + n]]
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        seq_of_token = np.repeat(np.arange(len(chunks)), lengths)
        widest = max(c.request.blocks_per_layer for c in chunks)
        tables = np.zeros((self.num_layers, len(chunks), widest), dtype=np.int32)
        for s, chunk in enumerate(chunks):
            for layer, blocks in enumerate(chunk.request.layers):
                tables[layer, s, :len(blocks.blocks)] = blocks.blocks
        slots = (tables[:, seq_of_token, positions // self.block_size].astype(np.int64) * self.block_size
                 + positions % self.block_size)
        query_start = np.zeros(len(chunks) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start[1:])
        seq_lens = np.asarray([s + n for s, n in zip(starts, lengths)], dtype=np.int32)

        device = self.device
        step = PagedStep(self.pool.tensor, torch.from_numpy(tables).to(device), torch.from_numpy(slots).to(device),
                         torch.from_numpy(seq_lens).to(device), torch.from_numpy(query_start).to(device), self.scale)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=device),
                            torch.from_numpy(positions).to(device), step)
        last = [query_start[i + 1] - 1 for i, c in enumerate(chunks) if c.samples]
        return self.model.logits(hidden[torch.tensor(last, dtype=torch.long, device=device)])
