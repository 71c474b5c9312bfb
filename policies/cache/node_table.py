"""The prefix cache's table of nodes, as the native engine's BlockManager (services/engine/native/) and
the simulator's count of blocks (sim/prefix_count.py) both keep it: which nodes are cached, which of
them are idle (per tier, in the cache policy's eviction order), who holds them, and their CaR scores.
No blocks, no I/O: what a node's blocks are and how they move is each keeper's own."""

from __future__ import annotations

from collections.abc import Iterable

from .cached_node import CachedNode
from .eviction_queue import EvictionQueue


class NodeTable:
    """Reads and writes `cached`, `evictable` (nodes no request holds, in any tier), `_idle` (those of
    each tier, queued in the cache policy's order) and a request's `scores` (node id -> (node, what
    the request added to its score))."""

    cached: dict[str, CachedNode]
    evictable: dict[str, CachedNode]
    _idle: dict[str, EvictionQueue]

    def add_score(self, request, nodes: Iterable[CachedNode], amount: int) -> None:
        """Add to the nodes' scores on the request's behalf (CaR III-B.3: it entered the window,
        or was sent to run); forget_scores takes it all back when the request ends."""
        for node in nodes:
            node.score += amount
            self._rescored(node)
            earlier, given = request.scores.get(node.node_id, (node, 0))
            # What it gave a node of the same content since evicted went with that node.
            request.scores[node.node_id] = node, (given if earlier is node else 0) + amount

    def forget_scores(self, request) -> None:
        """The request has ended: what it added leaves its nodes' scores (a node evicted and cached
        again since is another node, and keeps its score)."""
        for node_id, (node, given) in request.scores.items():
            if self.cached.get(node_id) is node:
                node.score -= given
                self._rescored(node)
        request.scores = {}

    def _pin(self, node: CachedNode) -> None:
        if node.refs == 0:
            del self.evictable[node.node_id]
            self._idle[node.tier].discard(node.node_id)
        node.refs += 1

    def _let_go(self, node_id: str) -> None:
        node = self.cached[node_id]
        node.refs -= 1
        if node.refs == 0:
            self.evictable[node_id] = node
            self._idle[node.tier].put(node.view())

    def _rescored(self, node: CachedNode) -> None:
        """A node's score changed: if idle, the cache policy ranks it again."""
        self._changed(node)
        if self.evictable.get(node.node_id) is node:
            self._idle[node.tier].put(node.view())

    def _changed(self, node: CachedNode, dropped: bool = False) -> None:
        """A node was cached, moved, rescored or dropped: the native engine journals it for the cache
        publisher (cache_tiers.py); nothing to do here."""
