"""Cache replacement: which unused prefix blocks to drop when the pool needs their space.

Signature: (candidates, needed) -> node ids to evict, at least `needed` of them when there are enough.
"""

from __future__ import annotations

from collections.abc import Sequence

from .views import CachedBlockView


def lru(candidates: Sequence[CachedBlockView], needed: int) -> list[str]:
    """Least recently used first."""
    return [c.node_id for c in sorted(candidates, key=lambda c: c.last_access)[:needed]]
