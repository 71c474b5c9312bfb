"""Blocks of requests: per-layer block tables over the tier pools, the prefix cache, copy-on-write
and swapping between tiers.

Reference counts live in the pools: a block's count is the number of requests whose table holds
it. A full block's content is named by its NodeID (chained hash of its parent's NodeID and its
tokens, CaR); once named it joins the prefix cache, is never written again, and outlives the
request: when no request holds it any more it stays, *evictable*, until the cache policy gives its
space to someone else. A request about to write into a block that is shared or named gets its own
copy first (copy-on-write).

CaR's two-tier reuse (`cache_cxl`): a node the device evicts moves to the cxl tier instead of being
dropped, and comes back to the device when a request hits it (or the prefetcher asks for it). Only
device nodes are ever held by requests. Each node carries CaR's score (III-B.3): what the live
requests that will use it added, taken back when they end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.policies.cache.replacement import RUN_SCORE, WINDOW_SCORE
from kvmesh.policies.cache.sparsify import kept_slots
from kvmesh.policies.offload.plan import OffloadCost
from kvmesh.policies.scheduling.layerkv import PrefillCost
from kvmesh.policies.swap_recompute import SwapCurves
from kvmesh.policies.views import CachedBlockView, PoolView

from ..eviction_queue import EvictionQueue
from ..kv_blocks import copy_block_rows
from .attention.block_copy import copy_rows
from .kv_pool import KVPool
from .policy_set import Policies
from .request import Request

@dataclass
class CachedNode:
    node_id: str
    blocks: list[int]     # one block per layer, in `tier`
    refs: int             # requests holding it (device nodes only), and pins while it moves
    last_access: float
    hits: int = 0
    tier: str = "device"
    score: int = 0        # CaR III-B.3: the sum of what live requests added (Request.scores)
    sparsified: bool = False  # CaR III-D: its least-attended tokens were dropped on the way to the cxl tier
    depth: int = 0        # its block's index in the prompt

    def view(self) -> CachedBlockView:
        return CachedBlockView(node_id=self.node_id, last_access=self.last_access, hits=self.hits, score=self.score,
                               tier=self.tier, depth=self.depth)


class BlockManager:
    def __init__(self, pools: dict[str, KVPool], num_layers: int, policies: Policies, model: str = "",
                 prefix_caching: bool = True, cache_cxl: bool = False, high_water: float = 0.9):
        self.pools = pools
        self.device = pools["device"]
        self.num_layers = num_layers
        self.block_size = self.device.shape.block_size
        self.policies = policies
        self.model = model
        self.prefix_caching = prefix_caching
        self.cache_cxl = cache_cxl and "cxl" in pools  # CaR: evicted nodes move to the cxl tier
        self.high_water = high_water   # CaR: share of the device tier in use past which idle nodes move out
        self.cached: dict[str, CachedNode] = {}
        self.evictable: dict[str, CachedNode] = {}    # nodes no request holds, in either tier
        self._idle = {tier: EvictionQueue(policies.cache_policy) for tier in pools}  # of those, per tier
        self._named: dict[str, set[int]] = {tier: set() for tier in pools}  # blocks that belong to a cached node
        self.hit_tokens = 0             # prompt tokens served from the prefix cache, all time
        self.lookup_blocks = 0          # full blocks looked up in the prefix cache, all time
        self.hit_blocks: Counter = Counter()  # of those, found, by the tier they were found in
        self.moved_nodes: Counter = Counter()  # nodes moved to a tier ("cxl": offloaded, "device": reloaded)
        self.moved_bytes: Counter = Counter()  # the KV bytes those moves copied, by the tier moved to
        # CaR III-D: per layer, the tokens of each block a node keeps when it first moves to the cxl
        # tier (the pools track tokens then: KVPool.track_tokens); None: nodes move whole.
        self.keep_tokens: list[int] | None = None
        # Nodes cached, moved or dropped since the cache publisher last looked (None: dropped); None
        # while no publisher reads it (services/engine/cache_publisher.py).
        self.cache_changes: dict[str, CachedNode | None] | None = None
        # CaR III-C.1: with `layerwise_reload` (an engine whose runner loads layer by layer), a reload
        # at a request's turn gives the nodes their device blocks now and copies into them inside the
        # next step, each layer before its attention; until then a node stays pinned, with its cxl
        # blocks, in `pending_loads`.
        self.layerwise_reload = False
        self.pending_loads: list[tuple[CachedNode, list[int]]] = []
        self.swap_curves: SwapCurves | None = None  # profiled at start (swap_profile.py), for the policies
        self.prefill_cost: PrefillCost | None = None  # profiled at start (layer_profile.py), for LayerKV
        self.offload_cost: OffloadCost | None = None
        # How whole blocks move between tiers; LayerKV's transfers swap in one that yields to a busy link.
        self.copy: Callable[[KVPool, list[int], KVPool, list[int]], None] = copy_blocks
        self._view: tuple[tuple[int, ...], PoolView] | None = None  # pool_view() and the counts it was built from

    # -- accounting -------------------------------------------------------------------------------

    @property
    def cache_tiers(self) -> list[str]:
        """The tiers the prefix cache's nodes live in."""
        return ["device", "cxl"] if self.cache_cxl else ["device"]

    def cache_table(self, tier: str | None, limit: int) -> list[CachedNode]:
        """CaR's cache table: the nodes (of `tier`, or all), highest score first, then the most recently used."""
        nodes = [n for n in self.cached.values() if tier is None or n.tier == tier]
        return sorted(nodes, key=lambda n: (-n.score, -n.last_access))[:limit]

    def cached_nodes(self) -> dict[str, int]:
        """Cached nodes by tier."""
        counts = Counter({tier: 0 for tier in self.cache_tiers})
        counts.update(node.tier for node in self.cached.values())
        return dict(counts)

    def free(self, tier: str) -> int:
        """Blocks of `tier` a request could get now (unused cached blocks count: they can be evicted)."""
        return self.pools[tier].free_count + len(self._idle[tier]) * self.num_layers

    def pool_view(self) -> PoolView:
        """What the policies see of the pools. Asked for by every policy call (several per request
        and step), it is rebuilt only when a count it reports has changed; read-only mappings, as
        every caller shares it."""
        counts = (*[len(self._idle[t]) for t in self.pools], *[p.free_count for p in self.pools.values()])
        if self._view is None or self._view[0] != counts:
            view = PoolView(block_size=self.block_size, num_layers=self.num_layers,
                            free=MappingProxyType({t: self.free(t) for t in self.pools}),
                            total=MappingProxyType({t: p.num_blocks for t, p in self.pools.items()}),
                            swap_curves=self.swap_curves, prefill_cost=self.prefill_cost,
                            offload_cost=self.offload_cost)
            self._view = counts, view
        return self._view[1]

    def use_swap_curves(self, curves: SwapCurves | None) -> None:
        """Hand profiled swap and recompute curves to the policies, from the next pool_view() on."""
        self.swap_curves, self._view = curves, None

    def use_layer_costs(self, prefill: PrefillCost | None, offload: OffloadCost | None) -> None:
        """Hand LayerKV's profiled prefill and offload fits to the policies, from the next pool_view() on."""
        self.prefill_cost, self.offload_cost, self._view = prefill, offload, None

    # -- prefix cache -----------------------------------------------------------------------------

    def attach_prefix(self, request: Request, now: float) -> int:
        """Give a request with no blocks the longest cached prefix of its tokens; returns how many
        tokens it need not compute. At least one token is always left to compute (its logits are
        needed), so a fully cached prompt recomputes its last token into a copy of the last block.
        Nodes of the prefix in the cxl tier come back to the device first, as many as it has room
        for; the prefix ends where one could not."""
        if not self.prefix_caching or request.blocks_per_layer:
            return 0
        hits = self.cached_prefix(request)
        found_in = [node.tier for node in hits]
        self.reload(hits, layerwise=self.layerwise_reload)
        for node, tier in zip(hits, found_in):
            if node.tier != "device":
                break
            self.hit_blocks[tier] += 1
            self._hold(request, node, now)
        request.num_committed = len(request.cached_nodes)
        request.num_computed = min(request.num_committed * self.block_size, request.num_tokens - 1)
        self.hit_tokens += request.num_computed
        self.lookup_blocks += len(request.node_ids)
        return request.num_computed

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
        blocks and idle nodes no live request will use (score <= 0), so one window request's
        prefetch never pushes out another's."""
        cold = [n for n in nodes if n.tier != "device"]
        if not cold:
            return 0
        max_score = 0 if spare_only else None
        for node in nodes:   # pinned: the room made for them must not come from them
            self._pin(node)
        try:
            spare = self.free("device") if max_score is None else self.device.free_count + self.num_layers * sum(
                n.tier == "device" and n.score <= max_score for n in self.evictable.values())
            fit = min(len(cold), spare // self.num_layers)
            cold = cold[:fit]
            fresh = self._take(fit * self.num_layers, max_score=max_score)
            if layerwise:
                self._defer(cold, fresh)
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

    def _hold(self, request: Request, node: CachedNode, now: float) -> None:
        self._pin(node)
        node.hits += 1
        node.last_access = now
        for layer, block in zip(request.layers, node.blocks):
            self.device.incref(block)
            layer.blocks.append(block)
        request.cached_nodes.append(node.node_id)

    def _pin(self, node: CachedNode) -> None:
        if node.refs == 0:
            del self.evictable[node.node_id]
            self._idle[node.tier].discard(node.node_id)
        node.refs += 1

    def _let_go(self, node_id: str) -> None:
        node = self.cached[node_id]
        node.refs -= 1
        if node.refs == 0:
            self.evictable[node_id] = node
            self._idle[node.tier].put(node.view())

    def _rescored(self, node: CachedNode) -> None:
        """An idle node's score changed: the cache policy ranks it again."""
        self._changed(node)
        if self.evictable.get(node.node_id) is node:
            self._idle[node.tier].put(node.view())

    # -- CaR: scores, tiers of the cache ----------------------------------------------------------

    def add_score(self, request: Request, nodes: Iterable[CachedNode], amount: int) -> None:
        """Add to the nodes' scores on the request's behalf (CaR III-B.3: it entered the window,
        or was sent to run); forget_scores takes it all back when the request ends."""
        for node in nodes:
            node.score += amount
            self._rescored(node)
            earlier, given = request.scores.get(node.node_id, (node, 0))
            # What it gave a node of the same content since evicted went with that node.
            request.scores[node.node_id] = node, (given if earlier is node else 0) + amount

    def forget_scores(self, request: Request) -> None:
        """The request has ended: what it added leaves its nodes' scores (a node evicted and cached
        again since is another node, and keeps its score)."""
        for node_id, (node, given) in request.scores.items():
            if self.cached.get(node_id) is node:
                node.score -= given
                self._rescored(node)
        request.scores = {}

    def offload_idle(self) -> int:
        """CaR III-C.2: with more than `high_water` of the device tier in use, move idle nodes to the
        cxl tier, lowest score first (the cache policy's order), until it is not; returns how many.
        Allocations then find room without waiting for a copy."""
        over = self.device.num_blocks - self.device.free_count - int(self.high_water * self.device.num_blocks)
        if not self.cache_cxl or over <= 0:
            return 0
        return self._evict("device", -(-over // self.num_layers))

    def clear_cache(self) -> None:
        """Forget every cached node no request holds, in every tier."""
        for node in list(self.evictable.values()):
            self._drop_node(node)

    def _evict(self, tier: str, nodes_needed: int, max_score: float | None = None) -> int:
        """Free the space of `nodes_needed` idle nodes of `tier` (the cache policy picks them, among
        those scored at most `max_score` if given): device nodes move to the cxl tier while it has
        room (CaR), else they are dropped."""
        idle = self._idle[tier]
        if idle.rank is not self.policies.cache_policy:   # switched at run time (PUT /v1/policy)
            idle.use(self.policies.cache_policy)
        chosen = [self.cached[i] for i in idle.pop(nodes_needed, None if max_score is None else
                                                     lambda node: node.score <= max_score)]
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

    def _defer(self, nodes: list[CachedNode], fresh: list[int]) -> None:
        """Give pinned cxl nodes their device blocks `fresh` now, the copy into them left to the step
        (layer_loads); each stays pinned, its cxl blocks kept, until loads_done."""
        cxl = self.pools["cxl"]
        for i, node in enumerate(nodes):
            blocks = fresh[i * self.num_layers:(i + 1) * self.num_layers]
            self.pending_loads.append((node, node.blocks))
            self.moved_bytes["device"] += self._kv_bytes(cxl, node.blocks)
            if self.device.valid is not None:   # masks now: the step's attention reads them from its start
                self.device.take_masks(cxl, node.blocks, blocks)
            self._rehome(node, self.device, blocks)
            self._pin(node)

    def layer_loads(self) -> list[tuple[KVPool, list[int], KVPool, list[int]]] | None:
        """The pending reloads as one copy a layer (cxl pool and blocks, device pool and blocks);
        None when there are none."""
        if not self.pending_loads:
            return None
        cxl = self.pools["cxl"]
        return [(cxl, [sources[layer] for _, sources in self.pending_loads], self.device,
                 [node.blocks[layer] for node, _ in self.pending_loads]) for layer in range(self.num_layers)]

    def loads_done(self) -> None:
        """The step copied every pending reload: free their cxl blocks and unpin the nodes."""
        for node, sources in self.pending_loads:
            for block in sources:
                self._named["cxl"].discard(block)
                self.pools["cxl"].release(block)
            self._let_go(node.node_id)
        self.pending_loads = []

    def flush_loads(self) -> None:
        """Copy every pending reload now (a step that runs no model), then as loads_done."""
        for copy in self.layer_loads() or []:
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

    # -- growing, writing, freeing ----------------------------------------------------------------

    def reserve(self, request: Request, blocks_per_layer: int, new_tokens: int) -> bool:
        """Make room for this step's `new_tokens`: bring every layer to `blocks_per_layer` blocks in
        the layer's tier, and give the request its own copy of any shared or cached block it will
        write into (copy-on-write; only device blocks are ever shared). All or nothing: False, with
        nothing changed, if the pools can't."""
        extra = max(0, blocks_per_layer - request.blocks_per_layer)
        first = request.num_computed // self.block_size
        last = min((request.num_computed + new_tokens - 1) // self.block_size, request.blocks_per_layer - 1)
        on_device = [layer for layer in request.layers if layer.tier == "device"]
        shared = [i for i in range(first, last + 1) if any(self._shared(layer.blocks[i]) for layer in on_device)]
        if not extra and not shared:  # most decode steps: the request writes into its own last block
            return True
        elsewhere = Counter(layer.tier for layer in request.layers if layer.tier != "device")
        if self.free("device") < (extra + len(shared)) * len(on_device) or any(
                self.free(tier) < extra * n for tier, n in elsewhere.items()):
            return False
        fresh = iter(self._take((extra + len(shared)) * len(on_device)))
        for index in shared:
            for layer in on_device:
                old = layer.blocks[index]
                layer.blocks[index] = next(fresh)
                copy = layer.blocks[index]
                copy_blocks(self.device, [old], self.device, [copy])
                if copy in self.device.sparse:   # a sparsified node's: the slots it will write hold KV
                    self.device.valid[copy, max(0, request.num_computed - index * self.block_size):] = True
                    self.device.sparse[copy] = int(self.device.valid[copy].sum())
                self._drop(self.device, old)
            node_id = request.node_ids[index]
            if node_id in request.cached_nodes:
                request.cached_nodes.remove(node_id)
                self._let_go(node_id)
        for layer in request.layers:
            layer.blocks += [next(fresh) for _ in range(extra)] if layer.tier == "device" else \
                self._take(extra, layer.tier)
        return True

    def place(self, request: Request, device_layers: Sequence[int]) -> bool:
        """LayerKV: before a request gets its first blocks, keep only `device_layers` on the device
        tier and put the other layers' KV in the cxl tier. False (nothing changed) when the request
        already holds blocks or there is no cxl tier."""
        if request.blocks_per_layer or "cxl" not in self.pools:
            return False
        keep = set(device_layers)
        for index, layer in enumerate(request.layers):
            layer.tier = "device" if index in keep else "cxl"
        return True

    def release(self, request: Request) -> None:
        """Give up every block the request holds, in any tier."""
        for layer in request.layers:
            pool = self.pools[layer.tier]
            for block in layer.blocks:
                self._drop(pool, block)
            layer.blocks = []
            layer.tier = "device"
        for node_id in request.cached_nodes:
            self._let_go(node_id)
        request.cached_nodes = []
        request.num_committed = 0

    def lend(self, n: int) -> list[int]:
        """n device blocks for one step's LayerKV staging, held by no request (see give_back)."""
        return self._take(n)

    def give_back(self, blocks: Iterable[int]) -> None:
        """Return blocks lent for a step."""
        for block in blocks:
            self._drop(self.device, block)

    def _shared(self, block: int) -> bool:
        return block in self._named["device"] or self.device.refs(block) > 1

    def _drop(self, pool: KVPool, block: int) -> None:
        if pool.decref(block) == 0 and block not in self._named[pool.tier]:
            pool.release(block)

    def _take(self, n: int, tier: str = "device", max_score: float | None = None) -> list[int]:
        """n blocks of `tier`, making room from idle cached nodes (scored at most `max_score`, if
        given) if the free list is short."""
        pool = self.pools[tier]
        short = n - pool.free_count
        if short > 0 and self._idle[tier]:
            self._evict(tier, -(-short // self.num_layers), max_score)
        return pool.allocate(n)

    # -- swapping between tiers -------------------------------------------------------------------

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


def copy_blocks(source: KVPool, source_blocks: list[int], target: KVPool, target_blocks: list[int]) -> None:
    """Copy blocks between pools (GPU<->CXL DMA when the pools are on different devices): whole
    blocks, but of a sparsified block (CaR III-D) only the slots that hold KV; masks follow."""
    if not source_blocks:
        return
    if source.sparse.keys().isdisjoint(source_blocks):
        _copy_whole(source, source_blocks, target_blocks, target=target)
    else:
        dense = [b not in source.sparse for b in source_blocks]
        for copy, wanted in ((_copy_whole, True), (_copy_present, False)):
            pairs = [(s, t) for s, t, d in zip(source_blocks, target_blocks, dense) if d == wanted]
            if pairs:
                copy(source, [s for s, _ in pairs], [t for _, t in pairs], target=target)
    if target.valid is not None:
        target.take_masks(source, source_blocks, target_blocks)


def _copy_present(source: KVPool, source_blocks: list[int], target_blocks: list[int], *, target: KVPool) -> None:
    """Copy the K and V rows of the slots that hold KV, in one gather and scatter."""
    block_size = source.shape.block_size
    blocks = torch.tensor(source_blocks, device=source.valid.device)
    present = source.valid[blocks]   # [n, block_size]
    offsets = torch.arange(block_size, device=present.device)
    # In a pool viewed as rows of [Hkv, D], a slot's K row is 2 * block_size * block + offset; V is block_size on.
    src = (blocks[:, None] * (2 * block_size) + offsets)[present]
    dst = (torch.tensor(target_blocks, device=present.device)[:, None] * (2 * block_size) + offsets)[present]
    src, dst = src.to(source.tensor.device), dst.to(target.tensor.device)
    rows, target_rows = source.tensor.view(-1, *source.tensor.shape[3:]), target.tensor.view(-1, *target.tensor.shape[3:])
    for shift in (0, block_size):
        target_rows.index_copy_(0, dst + shift, rows.index_select(0, src + shift).to(target_rows.device))


def _copy_whole(source: KVPool, source_blocks: list[int], target_blocks: list[int], *, target: KVPool) -> None:
    if not copy_rows(source.tensor, source_blocks, target.tensor, target_blocks):
        copy_block_rows(source.tensor, source_blocks, target.tensor, target_blocks)


