"""BlockManager's accounting: what the pools hold and what the policies see of them (block_manager.py)."""

from __future__ import annotations

from collections import Counter
from types import MappingProxyType

from kvmesh.policies.cache.cached_node import CachedNode
from kvmesh.policies.costs import OffloadCost, PrefillCost, SwapCurves
from kvmesh.policies.views import PoolView


class BlockAccounting:
    """Counts of the pools and the prefix cache, and the profiled costs handed to the policies.

    Reads `pools`, `num_layers`, `block_size`, `cache_cxl`, `cached` and `_idle`; writes
    `swap_curves`, `prefill_cost`, `offload_cost` and `_view` (pool_view's cached answer)."""

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
