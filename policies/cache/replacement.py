"""Cache replacement: which idle prefix-cache nodes give up their space when a pool needs it.

Signature: (candidates, needed) -> node ids to evict, at least `needed` of them when there are enough.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.policies.views import CachedBlockView

# CaR III-B.3's score rules, per node a request will reuse: +1 when the request enters the Shuffled
# Window, +1 when it is sent to run, -2 when it completes. The engine applies the -2 as "take back
# what this request added", so a request that leaves without running (aborted in the window) gives
# back only its +1, and a node the request creates while it runs starts at WINDOW_SCORE + RUN_SCORE,
# to be brought to 0 by the request's own completion. A node's score is then the number of live
# requests about to use it, twice for those running.
WINDOW_SCORE = 1
RUN_SCORE = 1
DONE_SCORE = -(WINDOW_SCORE + RUN_SCORE)


def lru(candidates: Sequence[CachedBlockView], needed: int) -> list[str]:
    """Least recently used first."""
    return [c.node_id for c in sorted(candidates, key=lambda c: c.last_access)[:needed]]


def car(candidates: Sequence[CachedBlockView], needed: int) -> list[str]:
    """CaR III-B.3: the lowest score first; among equal scores the least recently used (LRU as the
    tie-break), then the node id, so the order never depends on the candidates' order."""
    return [c.node_id for c in sorted(candidates, key=lambda c: (c.score, c.last_access, c.node_id))[:needed]]
