"""Cache replacement: which idle prefix-cache nodes give up their space first when a pool needs it.

A policy ranks one idle node: (view) -> a sortable key, the lowest evicted first. The engine keeps
its idle nodes in a heap by that key (policies/cache/eviction_queue.py), so it ranks a node when it
goes idle or its score changes, never every idle node per allocation. Every key ends with the
node's depth in its prefix chain, deepest first, then its id: among nodes a request let go of at
once, the chain's tail goes before the head it hangs from (a head evicted first would leave its
tail cached but unreachable), and the order never depends on the order nodes went idle.
"""

from __future__ import annotations

from kvmesh.policies.views import CachedBlockView

from .eviction_queue import EvictionQueue

# CaR III-B.3's score rules, per node a request will reuse: +1 when the request enters the Shuffled
# Window, +1 when it is sent to run, -2 when it completes. The engine applies the -2 as "take back
# what this request added", so a request that leaves without running (aborted in the window) gives
# back only its +1, and a node the request creates while it runs starts at WINDOW_SCORE + RUN_SCORE,
# to be brought to 0 by the request's own completion. A node's score is then the number of live
# requests about to use it, twice for those running.
WINDOW_SCORE = 1
RUN_SCORE = 1
DONE_SCORE = -(WINDOW_SCORE + RUN_SCORE)
# The most a node may score to be moved in the background: out by the idle offload (III-C.2) or to
# make room for a prefetch (III-B.2). A node scored higher will be reused by a live request (a window
# request's, prefetched or still on the device): moved out, it comes back for that request, bytes
# moved for nothing both ways (issue 31: the idle offload took prefetched nodes out while their turn
# waited and the prefetcher fetched them again). The paper offloads "based on the Policy's Score" and
# prefetches just in time, and does not let the one undo the other; only a request's own room (a turn
# admitted, a running request growing on a full device) pushes such a node out, and only once no
# unclaimed idle node is left (victims, below).
UNCLAIMED_SCORE = 0


def lru(node: CachedBlockView) -> tuple:
    """Least recently used first."""
    return node.last_access, -node.depth, node.node_id


def car(node: CachedBlockView) -> tuple:
    """CaR III-B.3: the lowest score first; among equal scores the least recently used (LRU as the
    tie-break)."""
    return node.score, node.last_access, -node.depth, node.node_id


def victims(idle: EvictionQueue, n: int, max_score: float | None = None) -> list[str]:
    """The `n` idle nodes that give up their room (fewer if there are not that many), in the cache
    policy's order but every node no live request will reuse (UNCLAIMED_SCORE) before any claimed one;
    claimed nodes only if `max_score` (None: no bound) lets them go. A request's own room takes a
    node a window request claimed (one the prefetcher brought back for it, say) only when nothing
    unclaimed is left, whatever the rank: with `lru`, a prefetched node, its last use long past, was
    the first to go. Not pinned: the scheduler does not count a window request's nodes as its room,
    so holding them would turn a running request's next block into a preemption (its context
    recomputed or swapped) to spare one node's reload; vLLM holds the blocks it loads for a waiting
    request only once its scheduler has allocated them to it (WAITING_FOR_REMOTE_KVS)."""
    unclaimed = UNCLAIMED_SCORE if max_score is None else min(max_score, UNCLAIMED_SCORE)
    taken = idle.pop(n, lambda node: node.score <= unclaimed)
    if len(taken) < n and (max_score is None or max_score > unclaimed):
        taken += idle.pop(n - len(taken), None if max_score is None else lambda node: node.score <= max_score)
    return taken
