"""BlockManager's swapping of a request's KV between tiers (block_manager.py): CacheOpt's swap out
and in, and LayerKV's offloading of layers."""

from __future__ import annotations

from collections.abc import Iterable

from .request import Request


class BlockSwap:
    """Reads `pools`, `num_layers` and `copy`; writes a request's layers (blocks and tiers),
    `cached_nodes` and `num_committed`. Blocks come from BlockGrowth._take and go back through
    BlockGrowth._drop; nodes are let go through PrefixCache."""

    def swap_out(self, request: Request) -> bool:
        """Move a request's KV to the cxl tier and free its device blocks; False if cxl is full. It
        lets go of the prefix-cache nodes it held: they stay cached for others."""
        if not self.move_layers(request, range(self.num_layers), "cxl"):
            return False
        for node_id in request.cached_nodes:
            self._let_go(node_id)
        request.cached_nodes, request.num_committed = [], 0
        return True

    def swap_in(self, request: Request) -> bool:
        """Bring a swapped-out request's KV back to device blocks, every layer; False if the device
        can't hold it."""
        return self.move_layers(request, range(self.num_layers), "device")

    def move_layers(self, request: Request, layers: Iterable[int], tier: str) -> bool:
        """Move the KV of the request's `layers` that are elsewhere into `tier` (swapping, LayerKV's
        offloading); False, with nothing changed, if `tier` cannot hold them. Prefix-cache nodes the
        request holds stay held: their device blocks stay cached whatever the request's copy does."""
        moving = [request.layers[i] for i in layers if request.layers[i].tier != tier]
        target = self.pools.get(tier)
        n = request.blocks_per_layer * len(moving)
        if target is None or self.free(tier) < n:
            return False
        fresh = iter(self._take(n, tier))
        for source_tier in {layer.tier for layer in moving}:
            group = [layer for layer in moving if layer.tier == source_tier]
            destination = [[next(fresh) for _ in layer.blocks] for layer in group]
            self.copy(self.pools[source_tier], [b for layer in group for b in layer.blocks], target,
                      [b for blocks in destination for b in blocks])
            for layer, blocks in zip(group, destination):
                for block in layer.blocks:
                    self._drop(self.pools[source_tier], block)
                layer.tier, layer.blocks = tier, blocks
        return True
