"""The vLLM backend's cxl-tier bytes: a layer's blocks saved into host slots come back, byte for byte,
into other blocks, layer by layer, whatever runs of blocks the two sides have."""

from __future__ import annotations

import torch

from kvmesh.services.engine.vllm_backend.host_tier import HostTier


def test_blocks_saved_layer_by_layer_come_back_into_other_blocks():
    torch.manual_seed(0)
    caches = {f"layer{i}": torch.randn(10, 2, 4, 3) for i in range(2)}   # [block, K/V, ...] as vLLM's CPU cache
    saved = {name: cache.clone() for name, cache in caches.items()}
    tier = HostTier(caches, capacity=5)
    assert tier.slot_bytes == 2 * (2 * 4 * 3 * 4)
    try:
        for name in caches:   # as save_kv_layer: after each layer, its blocks (a run and a stray one)
            tier.save_layer(name, [3, 4, 7], [1, 2, 0])
        tier.wait_for_saves()
        for cache in caches.values():
            cache.zero_()
        tier.start_loads([1, 2, 0], [0, 5, 9])
        for name in caches:   # as wait_for_layer_load, in the model's order
            tier.wait_for_layer(name)
            assert torch.equal(caches[name][[0, 5, 9]], saved[name][[3, 4, 7]])
        tier.wait_for_saves()
        assert tier.load_seconds > 0
        assert all(int(torch.count_nonzero(c[[1, 2, 3, 4, 6, 7, 8]])) == 0 for c in caches.values())   # nothing else written
    finally:
        tier.close()
