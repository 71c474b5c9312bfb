"""The native engine's prefix cache as the cache publisher reads it (cache_publisher.py)."""

from __future__ import annotations

from kvmesh.libs.kvmeta.messages import CacheEntry

from ..cache_publisher import CacheJournal
from .block_manager import BlockManager


def native_journal(blocks: BlockManager) -> CacheJournal:
    return CacheJournal(take=blocks.take_cache_changes, nodes=lambda: blocks.cached.values(),
                        note=blocks.note_cache_changes,
                        entry=lambda n: CacheEntry(node_id=n.node_id, tier=n.tier, size=blocks.node_bytes(n),
                                                   score=float(n.score)))
