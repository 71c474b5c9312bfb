"""CaR III-D's token scores: how much attention each token's KV draws, which decides what a node
keeps when it is sparsified on its way to the cxl tier.

The attention kernel does not hand back its probabilities, so the scores come from observation
queries (SnapKV's observation window, one query long): the last query of each prompt, and of each
decode step that fills a block. For those, after each layer's attention, the probe recomputes that
one query's attention over the sequence's context and adds it, averaged over heads, to the scores
of the slots it read (KVPool.scores; zeroed when a block is freed). That is one query's attention
per observed sequence and layer, at a prompt's end and once in block_size decode steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ScoreProbe:
    def __init__(self, pool: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor, scale: float):
        self.pool, self.valid, self.scores, self.scale = pool, valid, scores, scale
        self.block_size = pool.shape[2]

    def wrap(self, attention: Attention, tables: torch.Tensor, observed: Sequence[tuple[int, int, int]]) -> Attention:
        """`attention`, then the observed queries' scores; `observed`: (sequence, query row, context
        length) of each sequence observed this step; `tables`: the step's [layers, seqs, blocks]."""
        if not observed:
            return attention
        offsets = torch.arange(self.block_size, device=self.pool.device)
        contexts = []
        for seq, row, length in observed:
            blocks = tables[:, seq, :-(-length // self.block_size)].long()   # [layers, n]
            slots = (blocks[..., None] * self.block_size + offsets).flatten(1)[:, :length]
            contexts.append((row, slots))

        def observed_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = attention(layer, q, k, v)
            for row, slots in contexts:
                self._score(q[row], slots[layer])
            return out

        return observed_attention

    def _score(self, query: torch.Tensor, slots: torch.Tensor) -> None:
        # In the pool viewed as rows of [Hkv, D], slot s's K row is s + (s // block_size) * block_size.
        keys = self.pool.view(-1, *self.pool.shape[3:]).index_select(0, slots + slots // self.block_size * self.block_size)
        heads, dim = query.shape
        grouped = query.float().view(keys.shape[1], heads // keys.shape[1], dim)
        logits = torch.einsum("hgd,thd->hgt", grouped, keys.float()) * self.scale
        logits = logits.masked_fill(~self.valid.view(-1)[slots], float("-inf"))
        self.scores.view(-1).index_add_(0, slots, logits.softmax(-1).mean((0, 1)))
