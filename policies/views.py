"""Read-only views the engine hands its policies: what the papers' equations read, nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str
    arrival: float            # seconds, engine clock
    prompt_len: int
    num_tokens: int           # prompt + generated so far
    num_computed: int         # tokens whose KV is in the cache
    num_generated: int
    max_tokens: int
    blocks_per_layer: int     # blocks the request holds in each layer
    tier: str                 # where those blocks are: "device", or "cxl" when swapped out
    preemptions: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_generated


@dataclass(frozen=True, slots=True)
class PoolView:
    block_size: int
    num_layers: int
    free: Mapping[str, int]    # per tier: blocks free now (cached-but-unused ones included)
    total: Mapping[str, int]

    def blocks_for(self, tokens: int) -> int:
        """Blocks one layer needs for `tokens` tokens."""
        return blocks_for(tokens, self.block_size)


@dataclass(frozen=True, slots=True)
class CachedBlockView:
    """A prefix block nobody uses now, kept for reuse until its space is needed."""

    node_id: str
    last_access: float
    hits: int
    score: float = 0.0


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that `tokens` tokens fill (the last one partly)."""
    return -(-tokens // block_size)
