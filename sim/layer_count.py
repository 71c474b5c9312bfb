"""The simulator's blocks layer by layer, for LayerKV: per request and layer, which tier its blocks are
in, as the native BlockManager places, moves and lends them (services/engine/native/block_growth.py
and block_swap.py; policies/iteration/seams.py's LayeredBlocks), with no tensors. The pool view
carries LayerKV's fitted costs (Eq. 3 and 4), as the native engine hands its policies the ones it
profiled at start.

A request is counted layer by layer from its first blocks on: `layers` (a LayerTier each), and the
`offloaded` layers, `device_layers` and `tier` derived from them, are set here whenever a layer
moves, and cleared when the request lets its blocks go; a request's layers all hold
`blocks_per_layer` blocks, each in its layer's tier. Lent blocks (a step's staging area) are held by
no request until `give_back`, after the step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.views import PoolView

from .block_count import BlockCount
from .request import LayerTier, SimRequest

TIERS = {tier: LayerTier(tier) for tier in ("device", "cxl")}


class LayerCount(BlockCount):
    def __init__(self, block_size: int, num_layers: int, totals: Mapping[str, int],
                 prefill_cost: PrefillCost | None = None, offload_cost: OffloadCost | None = None):
        super().__init__(block_size, num_layers, totals)
        self.prefill_cost, self.offload_cost = prefill_cost, offload_cost
        self.lent = 0  # device blocks lent for this step's staging area

    def pool_view(self) -> PoolView:
        return replace(super().pool_view(), prefill_cost=self.prefill_cost, offload_cost=self.offload_cost)

    def reserve(self, request: SimRequest, blocks_per_layer: int, new_tokens: int) -> bool:
        """Bring every layer to `blocks_per_layer` blocks, each in its layer's tier; all or nothing."""
        extra = max(0, blocks_per_layer - request.blocks_per_layer)
        if not request.layers:
            self._set(request, [request.tier] * self.num_layers)
        if not extra:
            return True
        on_device = request.device_layers
        elsewhere = self.num_layers - on_device
        if self.free("device") < extra * on_device or (elsewhere and self.free("cxl") < extra * elsewhere):
            return False
        self.free_blocks["device"] -= extra * on_device
        if elsewhere:
            self.free_blocks["cxl"] -= extra * elsewhere
        request.blocks_per_layer = blocks_per_layer
        return True

    def release(self, request: SimRequest) -> None:
        held = request.blocks_per_layer
        if request.layers:
            for layer in request.layers:
                self.free_blocks[layer.tier] += held
        else:
            self.free_blocks[request.tier] += held * self.num_layers
        request.blocks_per_layer, request.tier = 0, "device"
        request.layers, request.offloaded, request.device_layers = (), (), None

    def swap_out(self, request: SimRequest) -> bool:
        return self.move_layers(request, range(self.num_layers), "cxl")

    def swap_in(self, request: SimRequest) -> bool:
        return self.move_layers(request, range(self.num_layers), "device")

    def place(self, request: SimRequest, device_layers: Sequence[int]) -> bool:
        """Before its first blocks, keep only `device_layers` on the device and the others in the cxl
        tier; False (nothing changed) when it holds blocks or there is no cxl tier."""
        if request.blocks_per_layer or "cxl" not in self.totals:
            return False
        keep = set(device_layers)
        self._set(request, ["device" if i in keep else "cxl" for i in range(self.num_layers)])
        return True

    def move_layers(self, request: SimRequest, layers: Iterable[int], tier: str) -> bool:
        """Move the request's `layers` that are elsewhere into `tier`; False, nothing changed, when it
        cannot hold them. What moves is counted in `moved` (the step waits for the copies)."""
        tiers = [layer.tier for layer in request.layers] or [request.tier] * self.num_layers
        moving = [i for i in layers if tiers[i] != tier]
        n = request.blocks_per_layer * len(moving)
        if tier not in self.totals or self.free(tier) < n:
            return False
        for i in moving:
            self.free_blocks[tiers[i]] += request.blocks_per_layer
            tiers[i] = tier
        self.free_blocks[tier] -= n
        self.moved[tier] += n
        self._set(request, tiers)
        return True

    def lend(self, n: int) -> range:
        """n device blocks for this step's staging area (the scheduler checked they are free)."""
        self.free_blocks["device"] -= n
        self.lent += n
        return range(n)

    def give_back(self) -> None:
        """The step ran: the blocks lent for its staging area are free again."""
        self.free_blocks["device"] += self.lent
        self.lent = 0

    def _set(self, request: SimRequest, tiers: Sequence[str]) -> None:
        request.layers = tuple(TIERS[tier] for tier in tiers)
        request.offloaded = tuple(i for i, tier in enumerate(tiers) if tier != "device")
        request.device_layers = self.num_layers - len(request.offloaded)
        request.tier = "device" if request.device_layers else tiers[0]
