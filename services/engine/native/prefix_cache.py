"""BlockManager's prefix cache (block_manager.py): the nodes that name full blocks by their content,
looking a prompt up among them, offering a request's full blocks to them, and requests holding and
letting go of them (the table of nodes itself: policies/cache/node_table.py)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.policies.cache.cached_node import CachedNode
from kvmesh.policies.cache.node_table import NodeTable
from kvmesh.policies.cache.replacement import RUN_SCORE, UNCLAIMED_SCORE, WINDOW_SCORE

from .request import Request


class PrefixCache(NodeTable):
    """Reads `prefix_caching`, `layerwise_reload`, `model`, `device`, `block_size`, `num_layers`; writes
    `cached`, `evictable`, `_idle` (a node idle or held), `_named["device"]` (the blocks of nodes it
    caches), the device pool's references, the hit counters (`hit_tokens`, `lookup_blocks`,
    `hit_blocks`), and a request's `node_ids`, `cached_nodes`, `num_committed`, `num_computed` and
    its layers' blocks. Room comes from BlockAccounting.free and BlockGrowth._take; nodes of the
    cxl tier come back through CacheTiers (_move, _defer), which also scores and journals them."""

    def cached_prefix(self, request: Request) -> list[CachedNode]:
        """The cached nodes of the request's leading full blocks, in order, in any tier."""
        if not self.prefix_caching:
            return []
        self._name_full_blocks(request, request.num_tokens // self.block_size)
        hits = []
        for node_id in request.node_ids:
            node = self.cached.get(node_id)
            if node is None:
                break
            hits.append(node)
        return hits

    def reload(self, nodes: Sequence[CachedNode], spare_only: bool = False, layerwise: bool = False) -> int:
        """Bring the leading cxl-tier ones among `nodes` back to the device, in one copy, as many
        as the device has room for (evicting other idle nodes, never these); returns how many.
        attach_prefix calls it at a request's turn (`layerwise`: the copies wait for the step, see
        pending_loads); the prefetcher ahead of it, `spare_only`: then the room comes only from free
        blocks and idle nodes no live request will use (UNCLAIMED_SCORE), so one window request's
        prefetch never pushes out another's (and with `layerwise` the step copies them under its
        compute, waited for by no attention: pending_prefetches)."""
        cold = [n for n in nodes if n.tier != "device"]
        if not cold:
            return 0
        max_score = UNCLAIMED_SCORE if spare_only else None
        if spare_only and self.device.free_count < self.num_layers and not self.idle_device_nodes(max_score, nodes):
            return 0   # no room spare (most of the prefetcher's tries): no pins to undo, no re-ranking
        for node in nodes:   # pinned: the room made for them must not come from them
            self._pin(node)
        try:
            spare = self.free("device") if max_score is None else (
                self.device.free_count + self.num_layers * self.idle_device_nodes(max_score))
            fit = min(len(cold), spare // self.num_layers)
            cold = cold[:fit]
            fresh = self._take(fit * self.num_layers, max_score=max_score)
            if layerwise:
                self._defer(cold, fresh, prefetch=spare_only)
            else:
                self._move(cold, self.device, fresh)
        finally:
            for node in nodes:
                self._let_go(node.node_id)
        return len(cold)

    def commit(self, request: Request, now: float) -> None:
        """Offer the request's blocks that became full to the prefix cache. A block whose content
        another request cached first stays private."""
        full = request.num_computed // self.block_size
        if not self.prefix_caching or request.device_layers < self.num_layers or full <= request.num_committed:
            return
        self._name_full_blocks(request, full)
        for index in range(request.num_committed, full):
            node_id = request.node_ids[index]
            if node_id in self.cached:
                continue
            blocks = [layer.blocks[index] for layer in request.layers]
            node = self.cached[node_id] = CachedNode(node_id, blocks, refs=1, last_access=now, depth=index)
            self._changed(node)
            self._named["device"].update(blocks)
            request.cached_nodes.append(node_id)
            self.add_score(request, [node], WINDOW_SCORE + RUN_SCORE)  # as if it entered the window and ran
        request.num_committed = full

    def _name_full_blocks(self, request: Request, full: int) -> None:
        if len(request.node_ids) < full:
            start = len(request.node_ids) * self.block_size
            parent = request.node_ids[-1] if request.node_ids else None
            request.node_ids += node_ids(request.all_ids[start:full * self.block_size], self.block_size, self.model,
                                         parent)

    def _share(self, request: Request, node: CachedNode) -> None:
        for layer, block in zip(request.layers, node.blocks):
            self.device.incref(block)
            layer.blocks.append(block)

    def _named_full(self, request: Request) -> int:
        return len(request.node_ids)  # cached_prefix named every full block
