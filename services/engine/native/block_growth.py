"""BlockManager's growing, writing and freeing of a request's blocks (block_manager.py): room for a
step, copy-on-write of shared or cached blocks, LayerKV's placement of layers, freeing, and blocks
lent for a step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from .kv_pool import KVPool
from .pool_copy import copy_blocks
from .request import Request


class BlockGrowth:
    """Reads `pools`, `device`, `block_size`, `num_layers`, `_named` and `_idle`; writes a request's
    layers (blocks and tiers), `cached_nodes` and `num_committed`, and the pools' references and
    free lists (and a sparsified copy's mask). Room comes from BlockAccounting.free and, when the
    free list is short, CacheTiers._evict; nodes are let go through PrefixCache."""

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
