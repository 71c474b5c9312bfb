"""The prefix cache's table of nodes, as the native engine's BlockManager (services/engine/native/) and
the simulator's count of blocks (sim/prefix_count.py) both keep it: which nodes are cached, which of
them are idle (per tier, in the cache policy's eviction order), who holds them, and their CaR scores.
No blocks, no I/O: what a node's blocks are and how they move is each keeper's own."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .cached_node import CachedNode
from .eviction_queue import EvictionQueue


@dataclass(frozen=True)
class PrefixHit:
    """A request's cached prefix as attach_prefix would give it now, found without attaching it.
    `taken`: the device blocks (every layer's) attaching it takes out of `free("device")`, those of
    its idle device nodes (held, so no longer idle) and of its cxl nodes (reloaded)."""

    nodes: int = 0    # cached nodes of its leading full blocks: blocks a layer it would hold
    tokens: int = 0   # tokens it would not compute
    taken: int = 0


class NodeTable:
    """Reads and writes `cached`, `evictable` (nodes no request holds, in any tier), `_idle` (those of
    each tier, queued in the cache policy's order) and a request's `scores` (node id -> (node, what
    the request added to its score)); looking a prompt up, also the hit counters (`hit_tokens`,
    `lookup_blocks`, `hit_blocks`) and a request's `cached_nodes`, `num_committed` and `num_computed`,
    through the keeper's `cached_prefix` and `reload`."""

    cached: dict[str, CachedNode]
    evictable: dict[str, CachedNode]
    _idle: dict[str, EvictionQueue]

    def idle_device_nodes(self, max_score: float, excluding: Iterable[CachedNode] = ()) -> int:
        """Idle device nodes scored at most `max_score`, not among `excluding`: the room a prefetch
        (max_score UNCLAIMED_SCORE) may take from the cache without pushing out a node someone will use."""
        own = {node.node_id for node in excluding}
        return sum(n.tier == "device" and n.score <= max_score and n.node_id not in own
                   for n in self.evictable.values())

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

    def find_prefix(self, request) -> PrefixHit:
        """What attach_prefix would give the request, and take, if every cxl node of its prefix came
        back: nothing moves, nothing is counted, no node is touched. The scheduler attaches a prefix
        only once the request has room with it, so a request refused costs nothing."""
        if not self.prefix_caching or request.blocks_per_layer:
            return PrefixHit()
        hits = self.cached_prefix(request)
        taken = sum(node.tier != "device" or node.refs == 0 for node in hits) * self.num_layers
        return PrefixHit(len(hits), min(len(hits) * self.block_size, request.num_tokens - 1), taken)

    def attach_prefix(self, request, now: float) -> int:
        """Give a request with no blocks the longest cached prefix of its tokens; returns how many
        tokens it need not compute. At least one token is always left to compute (its logits are
        needed), so a fully cached prompt recomputes its last token into a copy of the last block.
        Nodes of the prefix in the cxl tier come back to the device first (`reload`), as many as it
        has room for; the prefix ends where one could not (the scheduler attaches a prefix only once
        find_prefix says it fits whole)."""
        if not self.prefix_caching or request.blocks_per_layer:
            return 0
        hits = self.cached_prefix(request)
        found_in = [node.tier for node in hits]
        self.reload(hits, layerwise=self.layerwise_reload)
        for node, tier in zip(hits, found_in):
            if node.tier != "device":
                break
            self.hit_blocks[tier] += 1
            self._pin(node)
            node.hits += 1
            node.last_access = now
            self._share(request, node)
            request.cached_nodes.append(node.node_id)
        request.num_committed = len(request.cached_nodes)
        request.num_computed = min(request.num_committed * self.block_size, request.num_tokens - 1)
        self.hit_tokens += request.num_computed
        self.lookup_blocks += self._named_full(request)
        return request.num_computed

    def _share(self, request, node: CachedNode) -> None:
        """The request holds the node's blocks as its next ones (each keeper counts or maps them)."""
        raise NotImplementedError

    def _named_full(self, request) -> int:
        """How many of the request's leading full blocks have a name to look up."""
        raise NotImplementedError

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
