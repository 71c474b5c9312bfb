"""The simulator's blocks with the prefix cache counted: block_count.py's free blocks per tier, plus the
cache's nodes (policies/cache/node_table.py, the table the native engine keeps) with no tensors. As
the native BlockManager (services/engine/native/prefix_cache.py, cache_tiers.py, block_growth.py,
block_swap.py) does, step for step: a request's full blocks are named by content (SimRequest's
`block_names`), committed as they fill, looked up when it is admitted, held while it runs, left
idle when it ends; room comes from idle nodes in the cache policy's order, and with `cache_cxl`
(CaR) an evicted device node moves to the cxl tier and comes back on a hit or a prefetch.

A node is one block a layer; here it names no block, it is counted: a request holding `h` nodes
and `b` blocks a layer owns `b - h` of them, the nodes' are the cache's. Every copy between tiers
is counted in bytes by why it was made (`copied`, for the reports): "offload"
(a device node evicted to make room, on the step's path), "offload_idle" (CaR III-C.2's asynchronous
offload past the high-water mark), "load" (a hit's nodes brought back at its turn, layer by layer
inside its step, III-C.1) and "prefetch" (III-B.2, ahead of its turn, under the step it begins with).
Each is also queued on its direction's link (`links`, cache_links.py, which the engine sets), where
the engine times it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from kvmesh.policies.cache.cached_node import CachedNode
from kvmesh.policies.cache.eviction_queue import EvictionQueue, Rank
from kvmesh.policies.cache.node_table import NodeTable
from kvmesh.policies.cache.replacement import RUN_SCORE, UNCLAIMED_SCORE, WINDOW_SCORE, victims
from kvmesh.policies.views import PoolView

from .block_count import BlockCount
from .cache_links import CacheLinks
from .request import SimRequest


class PrefixCount(NodeTable, BlockCount):
    def __init__(self, block_size: int, num_layers: int, totals: Mapping[str, int], cache_policy: Rank,
                 block_bytes: int, cache_cxl: bool = False, high_water: float = 0.9):
        """`cache_policy`: the cache_policy hook's rank; `block_bytes`: one block of one layer's KV;
        `cache_cxl`: evicted device nodes move to the cxl tier (CaR); `high_water`: the share of the
        device tier in use past which idle nodes move out after a step."""
        super().__init__(block_size, num_layers, totals)
        self.block_bytes = block_bytes
        self.cache_cxl = cache_cxl and "cxl" in totals
        self.layerwise_reload = self.cache_cxl   # as the native factory sets it: reloads at a turn run in its step
        self.prefix_caching = True
        self.high_water = high_water
        self.cached: dict[str, CachedNode] = {}
        self.evictable: dict[str, CachedNode] = {}
        self._idle = {tier: EvictionQueue(cache_policy) for tier in totals}
        self.pending_loads: list[CachedNode] = []  # reloaded or prefetched: pinned, cxl blocks kept, until loads_done
        self.hit_tokens = 0
        self.lookup_blocks = 0
        self.hit_blocks: Counter = Counter()   # found, by the tier they were found in
        self.moved_nodes: Counter = Counter()  # nodes moved to a tier
        self.copied: Counter = Counter()       # bytes copied between tiers, by why (the module's docstring)
        self.links: CacheLinks | None = None
        self._offloading_idle = False

    # -- what the scheduler asks (policies/iteration/seams.py's Blocks) ---------------------------

    def free(self, tier: str) -> int:
        """Blocks a request could get now: free ones and those of idle nodes (they can be evicted)."""
        idle = self._idle.get(tier)
        return self.free_blocks.get(tier, 0) + (len(idle) * self.num_layers if idle is not None else 0)

    def pool_view(self) -> PoolView:
        return PoolView(block_size=self.block_size, num_layers=self.num_layers,
                        free={tier: self.free(tier) for tier in self.totals}, total=dict(self.totals))

    def reserve(self, request: SimRequest, blocks_per_layer: int, new_tokens: int) -> bool:
        """As BlockGrowth.reserve: every layer to `blocks_per_layer` blocks, and a private copy of each
        node it holds that this step writes into (a fully cached prompt recomputes its last token)."""
        extra = max(0, blocks_per_layer - request.blocks_per_layer)
        first = request.num_computed // self.block_size
        last = min((request.num_computed + new_tokens - 1) // self.block_size, request.blocks_per_layer - 1)
        shared = [node_id for node_id in request.cached_nodes if first <= self.cached[node_id].depth <= last] \
            if request.tier == "device" else []
        if not extra and not shared:
            return True
        need = (extra + len(shared)) * self.num_layers
        if self.free(request.tier) < need:
            return False
        self._take(need, request.tier)
        for node_id in shared:
            request.cached_nodes.remove(node_id)
            self._let_go(node_id)
        request.blocks_per_layer += extra
        return True

    def release(self, request: SimRequest) -> None:
        self.free_blocks[request.tier] += (request.blocks_per_layer - len(request.cached_nodes)) * self.num_layers
        for node_id in request.cached_nodes:
            self._let_go(node_id)
        request.cached_nodes, request.num_committed = [], 0
        request.blocks_per_layer, request.tier = 0, "device"

    def _move(self, request: SimRequest, tier: str) -> bool:
        """As BlockSwap.move_layers, every layer: the request's copy moves (room made from idle nodes);
        the nodes it held stay cached, and a request swapped out lets go of them."""
        n = request.blocks_per_layer * self.num_layers
        if request.tier == tier:
            return True
        if tier not in self.totals or self.free(tier) < n:
            return False
        self._take(n, tier)
        self.free_blocks[request.tier] += (request.blocks_per_layer - len(request.cached_nodes)) * self.num_layers
        request.tier = tier
        self.moved[tier] += n
        if tier == "cxl":
            for node_id in request.cached_nodes:
                self._let_go(node_id)
            request.cached_nodes, request.num_committed = [], 0
        return True

    def _share(self, request: SimRequest, node: CachedNode) -> None:
        request.blocks_per_layer += 1

    def _named_full(self, request: SimRequest) -> int:
        return min(request.num_tokens // self.block_size, len(request.block_names))

    def commit(self, request: SimRequest, now: float) -> None:
        """As PrefixCache.commit: the request's blocks that became full join the cache (one whose
        content another request cached first stays private)."""
        full = min(request.num_computed // self.block_size, len(request.block_names))
        if request.tier != "device" or full <= request.num_committed:
            return
        for index in range(request.num_committed, full):
            node_id = request.block_names[index]
            if node_id in self.cached:
                continue
            node = self.cached[node_id] = CachedNode(node_id, [], refs=1, last_access=now, depth=index)
            request.cached_nodes.append(node_id)
            self.add_score(request, [node], WINDOW_SCORE + RUN_SCORE)  # as if it entered the window and ran
        request.num_committed = full

    # -- what CaR's Reuse asks (policies/iteration/reuse.py) --------------------------------------

    def cached_prefix(self, request: SimRequest) -> list[CachedNode]:
        """The cached nodes of the request's leading full blocks, in order, in any tier."""
        hits = []
        for node_id in request.block_names[:request.num_tokens // self.block_size]:
            node = self.cached.get(node_id)
            if node is None:
                break
            hits.append(node)
        return hits

    def node_bytes(self, node: CachedNode) -> int:
        """CaR's Size: a node's KV, every layer's block (nodes move whole: no sparsification)."""
        return self.block_bytes * self.num_layers

    def reload(self, nodes: Sequence[CachedNode], spare_only: bool = False, layerwise: bool = False) -> int:
        """As PrefixCache.reload: the leading cxl nodes among `nodes` back to the device, as many as it
        has room for (never evicting these; a prefetch, `spare_only`, only free blocks and idle nodes
        scored at most UNCLAIMED_SCORE); with `layerwise` each stays pinned, its cxl blocks held,
        until loads_done."""
        cold = [n for n in nodes if n.tier != "device"]
        if not cold:
            return 0
        max_score = UNCLAIMED_SCORE if spare_only else None
        if spare_only and self.free_blocks["device"] < self.num_layers and not self.idle_device_nodes(max_score, nodes):
            return 0   # as PrefixCache.reload: no room spare, no pins to undo
        for node in nodes:
            self._pin(node)
        spare = self.free("device") if max_score is None else (
            self.free_blocks["device"] + self.num_layers * self.idle_device_nodes(max_score))
        cold = cold[:min(len(cold), spare // self.num_layers)]
        self._take(len(cold) * self.num_layers, "device", max_score)
        self._copied("prefetch" if spare_only else "load", cold)
        for node in cold:
            if not layerwise:
                self.free_blocks["cxl"] += self.num_layers
            self._rehome(node, "device")
            if layerwise:
                self.pending_loads.append(node)
                self._pin(node)
        for node in nodes:
            self._let_go(node.node_id)
        return len(cold)

    def loads_done(self) -> None:
        """The step has copied every reload and prefetch begun with it: their cxl blocks are free, the
        nodes let go."""
        for node in self.pending_loads:
            self.free_blocks["cxl"] += self.num_layers
            self._let_go(node.node_id)
        self.pending_loads = []

    def offload_idle(self) -> int:
        """CaR III-C.2: past `high_water` of the device tier in use, idle nodes no live request will
        reuse (UNCLAIMED_SCORE) move to the cxl tier, lowest ranked first, until it is not or none is
        left; returns how many."""
        total = self.totals["device"]
        over = total - self.free_blocks["device"] - int(self.high_water * total)
        if not self.cache_cxl or over <= 0:
            return 0
        self._offloading_idle = True
        try:
            return self._evict("device", -(-over // self.num_layers), UNCLAIMED_SCORE)
        finally:
            self._offloading_idle = False

    # -- room ---------------------------------------------------------------------------------------

    def _take(self, n: int, tier: str, max_score: float | None = None) -> None:
        """n blocks of `tier`, evicting idle nodes (scored at most `max_score`, if given) when short."""
        short = n - self.free_blocks[tier]
        if short > 0 and self._idle[tier]:
            self._evict(tier, -(-short // self.num_layers), max_score)
        if self.free_blocks[tier] < n:
            raise AssertionError(f"{n} blocks of {tier} asked for, {self.free_blocks[tier]} there")
        self.free_blocks[tier] -= n

    def _evict(self, tier: str, nodes_needed: int, max_score: float | None = None) -> int:
        """As CacheTiers._evict: `victims` of `tier` give up their room; a device node moves to the
        cxl tier while it has room (CaR), else it is dropped."""
        chosen = [self.cached[i] for i in victims(self._idle[tier], nodes_needed, max_score)]
        for node in self._offload(chosen) if tier == "device" and self.cache_cxl else chosen:
            self._drop_node(node)
        return len(chosen)

    def _offload(self, nodes: list[CachedNode]) -> list[CachedNode]:
        """What fits of `nodes` to the cxl tier (its idle nodes dropped for room); the rest, to drop."""
        for node in nodes:
            self._pin(node)
        short = len(nodes) * self.num_layers - self.free_blocks["cxl"]
        if short > 0 and self._idle["cxl"]:
            self._evict("cxl", -(-short // self.num_layers))
        fit = min(len(nodes), self.free_blocks["cxl"] // self.num_layers)
        self.free_blocks["cxl"] -= fit * self.num_layers
        self._copied("offload_idle" if self._offloading_idle else "offload", nodes[:fit])
        for node in nodes[:fit]:
            self.free_blocks["device"] += self.num_layers
            self._rehome(node, "cxl")
        for node in nodes:
            self._let_go(node.node_id)
        return nodes[fit:]

    def _copied(self, why: str, nodes: list[CachedNode]) -> None:
        nbytes = len(nodes) * self.num_layers * self.block_bytes
        self.copied[why] += nbytes
        if self.links is not None and nodes:
            self.links.copied(why, nbytes, [node.node_id for node in nodes])

    def _rehome(self, node: CachedNode, tier: str) -> None:
        node.tier = tier
        self.moved_nodes[tier] += 1

    def _drop_node(self, node: CachedNode) -> None:
        del self.evictable[node.node_id]
        self._idle[node.tier].discard(node.node_id)
        del self.cached[node.node_id]
        self.free_blocks[node.tier] += self.num_layers
