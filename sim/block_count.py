"""The simulator's blocks: per tier, how many are free, and per request, how many it holds per layer
and in which tier; no tensors, no prefix cache. What the iteration scheduler asks of an engine's
blocks (policies/iteration/seams.py's Blocks), as the native BlockManager answers it for a request
whose layers are all in one tier (no LayerKV)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from kvmesh.policies.cache.node_table import PrefixHit
from kvmesh.policies.views import PoolView

from .request import SimRequest


class BlockCount:
    def __init__(self, block_size: int, num_layers: int, totals: Mapping[str, int]):
        """`totals`: each tier's blocks, every layer's together ("device", and "cxl" if there is one)."""
        self.block_size = block_size
        self.num_layers = num_layers
        self.totals = dict(totals)
        self.free_blocks = dict(totals)
        self.moved: Counter = Counter()  # blocks swaps copied into each tier, all time

    def free(self, tier: str) -> int:
        return self.free_blocks.get(tier, 0)

    def pool_view(self) -> PoolView:
        return PoolView(block_size=self.block_size, num_layers=self.num_layers, free=dict(self.free_blocks),
                        total=dict(self.totals))

    def reserve(self, request: SimRequest, blocks_per_layer: int, new_tokens: int) -> bool:
        """Bring every layer to `blocks_per_layer` blocks in its tier; all or nothing."""
        extra = max(0, blocks_per_layer - request.blocks_per_layer) * self.num_layers
        if extra > self.free(request.tier):
            return False
        self.free_blocks[request.tier] -= extra
        request.blocks_per_layer = max(request.blocks_per_layer, blocks_per_layer)
        return True

    def release(self, request: SimRequest) -> None:
        self.free_blocks[request.tier] += request.blocks_per_layer * self.num_layers
        request.blocks_per_layer, request.tier = 0, "device"

    def swap_out(self, request: SimRequest) -> bool:
        return self._move(request, "cxl")

    def swap_in(self, request: SimRequest) -> bool:
        return self._move(request, "device")

    def _move(self, request: SimRequest, tier: str) -> bool:
        """Every layer's blocks to `tier`; False, nothing changed, when it has no room (or is not there)."""
        n = request.blocks_per_layer * self.num_layers
        if request.tier == tier:
            return True
        if tier not in self.totals or self.free(tier) < n:
            return False
        self.free_blocks[request.tier] += n
        self.free_blocks[tier] -= n
        request.tier = tier
        self.moved[tier] += n
        return True

    # No prefix cache: nothing is cached, committed or scored.

    def find_prefix(self, request: SimRequest) -> PrefixHit:
        return PrefixHit()

    def attach_prefix(self, request: SimRequest, now: float) -> int:
        return 0

    def commit(self, request: SimRequest, now: float) -> None:
        pass

    def forget_scores(self, request: SimRequest) -> None:
        pass
