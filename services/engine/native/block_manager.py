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

The class is assembled here from one part per job, each its own module:

- block_accounting.py  BlockAccounting: what the pools hold and what the policies see of them
- prefix_cache.py      PrefixCache: looking prompts up in the prefix cache, committing full blocks,
                       reloading nodes (the nodes, their holders and scores: policies/cache/node_table.py)
- cache_tiers.py       CacheTiers (CaR): eviction and offloading to the cxl tier, sparsifying,
                       moving nodes between tiers, layer-by-layer reloads, the change journal
- block_growth.py      BlockGrowth: growing a request's blocks (copy-on-write), placing and freeing them
- block_swap.py        BlockSwap: moving a request's KV between tiers
- pool_copy.py         copy_blocks: copying blocks between pools
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvmesh.policies.cache.cached_node import CachedNode
from kvmesh.policies.cache.eviction_queue import EvictionQueue
from kvmesh.policies.costs import OffloadCost, PrefillCost, SwapCurves
from kvmesh.policies.iteration import Policies
from kvmesh.policies.views import PoolView

from .block_accounting import BlockAccounting
from .block_growth import BlockGrowth
from .block_swap import BlockSwap
from .cache_tiers import CacheTiers
from .kv_pool import KVPool
from .pool_copy import copy_blocks
from .prefix_cache import PrefixCache


class BlockManager(BlockAccounting, PrefixCache, CacheTiers, BlockGrowth, BlockSwap):
    """Blocks of requests and the prefix cache (see the module's docstring): __init__ holds the state
    every part reads and writes."""

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
        # blocks, in `pending_loads`. A prefetch (III-B.2) likewise, in `pending_prefetches`: copied
        # under the next step's compute, which no attention waits for.
        self.layerwise_reload = False
        self.pending_loads: list[tuple[CachedNode, list[int]]] = []
        self.pending_prefetches: list[tuple[CachedNode, list[int]]] = []
        self.swap_curves: SwapCurves | None = None  # profiled at start (swap_profile.py), for the policies
        self.prefill_cost: PrefillCost | None = None  # profiled at start (layer_profile.py), for LayerKV
        self.offload_cost: OffloadCost | None = None
        # How whole blocks move between tiers; LayerKV's transfers swap in one that yields to a busy link.
        self.copy: Callable[[KVPool, list[int], KVPool, list[int]], None] = copy_blocks
        self._view: tuple[tuple[int, ...], PoolView] | None = None  # pool_view() and the counts it was built from
