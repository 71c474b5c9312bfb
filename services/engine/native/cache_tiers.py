"""BlockManager's tiers of the prefix cache (CaR, block_manager.py): evicting idle nodes (to the cxl
tier while it has room, else dropping them), sparsifying them on the way, moving them between tiers
(whole, or layer by layer inside a step), and the journal of what changed for the cache publisher.
Nodes' scores are kept by the table of nodes (policies/cache/node_table.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvmesh.policies.cache.cached_node import CachedNode
from kvmesh.policies.cache.node_table import NodeTable
from kvmesh.policies.cache.replacement import UNCLAIMED_SCORE, victims
from kvmesh.policies.cache.sparsify import kept_slots

from .kv_pool import KVPool
from .layer_staging import Copy, NodeLoads


class CacheTiers(NodeTable):
    """Reads `policies` (the cache policy), `cache_cxl`, `high_water`, `keep_tokens`, `pools`,
    `num_layers`, `block_size` and `copy`; writes the nodes (tier, blocks, score, sparsified),
    `cached`, `evictable`, `_idle`, `_named`, the pools' blocks and masks, `moved_nodes`,
    `moved_bytes`, `pending_loads`, `pending_prefetches` and `cache_changes`. Pins and lets go of
    nodes through NodeTable."""

    def offload_idle(self) -> int:
        """CaR III-C.2: with more than `high_water` of the device tier in use, move idle nodes no live
        request will reuse (UNCLAIMED_SCORE) to the cxl tier, in the cache policy's order, until it is
        not or none is left; returns how many. Allocations then find room without waiting for a copy."""
        over = self.device.num_blocks - self.device.free_count - int(self.high_water * self.device.num_blocks)
        if not self.cache_cxl or over <= 0:
            return 0
        return self._evict("device", -(-over // self.num_layers), UNCLAIMED_SCORE)

    def clear_cache(self) -> None:
        """Forget every cached node no request holds, in every tier."""
        for node in list(self.evictable.values()):
            self._drop_node(node)

    def _evict(self, tier: str, nodes_needed: int, max_score: float | None = None) -> int:
        """Free the space of `nodes_needed` idle nodes of `tier` (`victims` picks them: the cache
        policy's order, unclaimed nodes first, none scored above `max_score` if given): device nodes
        move to the cxl tier while it has room (CaR), else they are dropped."""
        idle = self._idle[tier]
        if idle.rank is not self.policies.cache_policy:   # switched at run time (PUT /v1/policy)
            idle.use(self.policies.cache_policy)
        chosen = [self.cached[i] for i in victims(idle, nodes_needed, max_score)]
        for node in self._offload(chosen) if tier == "device" and self.cache_cxl else chosen:
            self._drop_node(node)
        return len(chosen)

    def _offload(self, nodes: list[CachedNode]) -> list[CachedNode]:
        """Move what fits of `nodes` to the cxl tier (dropping idle cxl nodes for room); the rest,
        which did not fit, to be dropped."""
        cxl = self.pools["cxl"]
        for node in nodes:
            self._pin(node)
        short = len(nodes) * self.num_layers - cxl.free_count
        if short > 0 and self._idle["cxl"]:
            self._evict("cxl", -(-short // self.num_layers))
        fit = min(len(nodes), cxl.free_count // self.num_layers)
        if self.keep_tokens is not None:
            self._sparsify(nodes[:fit])
        self._move(nodes[:fit], cxl, cxl.allocate(fit * self.num_layers))
        for node in nodes:
            self._let_go(node.node_id)
        return nodes[fit:]

    def _sparsify(self, nodes: list[CachedNode]) -> None:
        """CaR III-D: in each layer, keep the best-scored `keep_tokens` of each dense node's device
        block (the dropped slots are not copied out, and are masked wherever the node goes)."""
        dense = [node for node in nodes if not node.sparsified]
        if not dense:
            return
        device = self.device
        blocks = [block for node in dense for block in node.blocks]
        index = torch.tensor(blocks, device=device.valid.device)
        scores = device.scores[index].masked_fill(~device.valid[index], float("-inf")).tolist()
        keep = self.keep_tokens * len(dense)
        device.drop_tokens(blocks, [kept_slots(row, k) for row, k in zip(scores, keep)])
        for node in dense:
            node.sparsified = True

    def node_bytes(self, node: CachedNode) -> int:
        """CaR's Size: the bytes of KV a node holds (of a sparsified one, its kept tokens')."""
        return self._kv_bytes(self.pools[node.tier], node.blocks)

    def _kv_bytes(self, pool: KVPool, blocks: list[int]) -> int:
        """The bytes of KV `blocks` of `pool` hold: whole blocks, but only the kept slots of sparsified ones."""
        if not pool.sparse:   # the prefetcher asks it of every waiting turn's cxl nodes each step
            return len(blocks) * pool.shape.bytes
        tokens = sum(pool.sparse.get(block, self.block_size) for block in blocks)
        return tokens * (pool.shape.bytes // self.block_size)

    def _move(self, nodes: list[CachedNode], target: KVPool, fresh: list[int]) -> None:
        """Copy pinned nodes to `target` blocks `fresh` (just allocated), in one copy per source
        tier, and free where they were."""
        if not nodes:
            return
        source = self.pools[nodes[0].tier]
        sources = [b for n in nodes for b in n.blocks]
        self.moved_bytes[target.tier] += self._kv_bytes(source, sources)
        self.copy(source, sources, target, fresh)
        for i, node in enumerate(nodes):
            for block in node.blocks:
                self._named[source.tier].discard(block)
                source.release(block)
            self._rehome(node, target, fresh[i * self.num_layers:(i + 1) * self.num_layers])

    def _rehome(self, node: CachedNode, target: KVPool, blocks: list[int]) -> None:
        """A pinned node's blocks are now `blocks` of `target` (just allocated; its old ones are the
        caller's); idle again, in this tier, when let go."""
        node.blocks = blocks
        for block in blocks:
            target.decref(block)   # named, not held: a cached node's blocks have no references
        self._named[target.tier].update(blocks)
        node.tier = target.tier
        self.moved_nodes[target.tier] += 1
        self._changed(node)

    def _changed(self, node: CachedNode, dropped: bool = False) -> None:
        """Journal the node for the cache publisher (NodeTable's hook)."""
        if self.cache_changes is not None:
            self.cache_changes[node.node_id] = None if dropped else node

    def note_cache_changes(self, node_ids: Iterable[str]) -> None:
        """Journal these nodes again as they are now (cached, or dropped), unless newer news is there:
        for the publisher, when sending them failed."""
        if self.cache_changes is not None:
            for node_id in node_ids:
                self.cache_changes.setdefault(node_id, self.cached.get(node_id))

    def take_cache_changes(self) -> tuple[list[CachedNode], list[str]]:
        """For the cache publisher: the nodes cached or moved, and those dropped, since it last asked."""
        changes, self.cache_changes = self.cache_changes or {}, {}
        return [n for n in changes.values() if n is not None], [i for i, n in changes.items() if n is None]

    def _defer(self, nodes: list[CachedNode], fresh: list[int], prefetch: bool = False) -> None:
        """Give pinned cxl nodes their device blocks `fresh` now, the copy into them left to the step
        (layer_loads; with `prefetch`, among the copies no attention waits for); each stays pinned,
        its cxl blocks kept, until loads_done."""
        cxl = self.pools["cxl"]
        pending = self.pending_prefetches if prefetch else self.pending_loads
        for i, node in enumerate(nodes):
            blocks = fresh[i * self.num_layers:(i + 1) * self.num_layers]
            pending.append((node, node.blocks))
            self.moved_bytes["device"] += self._kv_bytes(cxl, node.blocks)
            if self.device.valid is not None:   # masks now: the step's attention reads them from its start
                self.device.take_masks(cxl, node.blocks, blocks)
            self._rehome(node, self.device, blocks)
            self._pin(node)

    def layer_loads(self) -> NodeLoads | None:
        """The pending reloads and prefetches, each as one copy a layer; None when there are none."""
        if not self.pending_loads and not self.pending_prefetches:
            return None
        return NodeLoads(self._by_layer(self.pending_loads), self._by_layer(self.pending_prefetches))

    def _by_layer(self, pending: list[tuple[CachedNode, list[int]]]) -> list[Copy]:
        """One copy a layer (cxl pool and blocks, device pool and blocks) of `pending`'s nodes; none
        when it is empty."""
        if not pending:
            return []
        cxl = self.pools["cxl"]
        return [(cxl, [sources[layer] for _, sources in pending], self.device,
                 [node.blocks[layer] for node, _ in pending]) for layer in range(self.num_layers)]

    def loads_done(self) -> None:
        """The step copied every pending reload and prefetch: free their cxl blocks and unpin the nodes."""
        for node, sources in [*self.pending_loads, *self.pending_prefetches]:
            for block in sources:
                self._named["cxl"].discard(block)
                self.pools["cxl"].release(block)
            self._let_go(node.node_id)
        self.pending_loads, self.pending_prefetches = [], []

    def flush_loads(self) -> None:
        """Copy every pending reload and prefetch now (a step that runs no model), then as loads_done."""
        loads = self.layer_loads()
        if loads is not None:
            for copy in [*loads.reloads, *loads.prefetches]:
                self.copy(*copy)
        self.loads_done()

    def _drop_node(self, node: CachedNode) -> None:
        self._changed(node, dropped=True)
        del self.evictable[node.node_id]
        self._idle[node.tier].discard(node.node_id)
        del self.cached[node.node_id]
        pool = self.pools[node.tier]
        for block in node.blocks:
            self._named[node.tier].discard(block)
            pool.release(block)
