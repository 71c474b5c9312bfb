"""What an engine on the vLLM backend refuses at start, and the size of its cxl tier (checked before
vLLM is imported, so these run without it)."""

from __future__ import annotations

import pytest

from kvmesh.libs.controlplane import ConfigError
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.defaults import decided
from kvmesh.services.engine.vllm_backend.settings import Geometry, check_config, cxl_tier_blocks

TINY = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, vocab_size=2048, hidden_size=256)
BLOCK_BYTES = 2 * 32 * 2 * 64 * 4 * 4   # K and V of 32 tokens, 2 heads of 64, float32, 4 layers


def vllm_engine(**settings) -> EngineConfig:
    return decided(EngineConfig(**{"backend": "vllm", "model": "tiny", "block_size": 32, **settings}))


@pytest.mark.parametrize("settings, message", [
    ({"prefix_cache_cxl": True, "prefix_caching": False}, "needs prefix_caching"),
    ({"prefix_cache_cxl": True, "prefix_cache_sparsify": True}, "prefix_cache_sparsify are the native engine's"),
    ({"layer_staging_blocks": 8}, "layer_staging_blocks are the native engine's"),
    ({"policies": {"preemption_strategy": "swap"}}, "preemption_strategy are the native engine's"),
    ({"block_size": 16}, "multiple of 32"),
])
def test_what_only_the_native_engine_has_is_a_config_error(settings, message):
    with pytest.raises(ConfigError, match=message):
        check_config(vllm_engine(**settings))


def test_the_cxl_tier_holds_cxl_blocks_or_what_cxl_bytes_holds():
    assert cxl_tier_blocks(vllm_engine(), TINY) == 0                                   # no prefix_cache_cxl
    assert cxl_tier_blocks(vllm_engine(prefix_cache_cxl=True, cxl_blocks=7), TINY) == 7
    assert cxl_tier_blocks(vllm_engine(prefix_cache_cxl=True, cxl_bytes=10 * BLOCK_BYTES + 1), TINY) == 10
    with pytest.raises(ConfigError, match="holds no block"):
        cxl_tier_blocks(vllm_engine(prefix_cache_cxl=True, cxl_bytes=BLOCK_BYTES - 1), TINY)
