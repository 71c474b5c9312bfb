"""A node of the prefix cache: one full block's KV, named by its content (CaR's NodeID), kept after the
requests that wrote it end. The native engine's BlockManager and the simulator's count keep the same
nodes (node_table.py); only the engine's have blocks."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.policies.views import CachedBlockView


@dataclass
class CachedNode:
    node_id: str
    blocks: list[int]     # one block per layer, in `tier` (the simulator counts blocks: none named)
    refs: int             # requests holding it (device nodes only), and pins while it moves
    last_access: float
    hits: int = 0
    tier: str = "device"
    score: int = 0        # CaR III-B.3: the sum of what live requests added (a request's `scores`)
    sparsified: bool = False  # CaR III-D: its least-attended tokens were dropped on the way to the cxl tier
    depth: int = 0        # its block's index in the prompt

    def view(self) -> CachedBlockView:
        return CachedBlockView(node_id=self.node_id, last_access=self.last_access, hits=self.hits, score=self.score,
                               tier=self.tier, depth=self.depth)
