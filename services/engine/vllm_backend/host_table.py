"""The cxl tier's table on a vLLM engine (CaR III-B.1 and III-B.3, scheduler side of KVMeshConnector).

vLLM keeps its own prefix cache on the device; the connector adds a second tier in host memory (the
`cxl` tier: a RAM or CXL-attached buffer, a block of every layer per slot). This table says which
prefix blocks are there, by kvmesh NodeID (libs/kvmeta/nodeid: the names the native engine and the
scheduler's prefix routing use), and in which slot. A slot is taken for every full block a request
computes that the tier does not hold yet (a write-through copy, made off the critical path by the
worker); when no slot is free, the idle nodes CaR's replacement ranks lowest give theirs up. A
node's score counts the running requests that use it (RUN_SCORE + WINDOW_SCORE each, given back
when the request ends: vLLM has no Shuffled Window, so every request counts as in it when it runs).
Nodes a step loads from or saves into are pinned until that step's metadata is built.

No vLLM import here: the table is plain state, tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.policies.cache.eviction_queue import EvictionQueue, Rank
from kvmesh.policies.cache.replacement import DONE_SCORE, RUN_SCORE, WINDOW_SCORE
from kvmesh.policies.views import CachedBlockView


@dataclass
class HostNode:
    node_id: str
    slot: int
    last_access: float
    score: int = 0
    hits: int = 0
    pins: int = 0
    depth: int = 0      # its block's index in the prompt (replacement takes a chain's tail first)


@dataclass
class HostTable:
    capacity: int
    replacement: Rank
    nodes: dict[str, HostNode] = field(default_factory=dict)
    # All time: blocks looked up, found (and loaded), written to the tier, and nodes evicted from it.
    looked_up: int = 0
    loaded: int = 0
    saved: int = 0
    evicted: int = 0
    _free: list[int] = field(default_factory=list)
    _idle: EvictionQueue = field(init=False)            # the unpinned nodes, in the replacement's order
    _changed: set[str] = field(default_factory=set)     # published to kvmeta next
    _dropped: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"the cxl tier needs a capacity >= 0 blocks, got {self.capacity}")
        self._free = list(range(self.capacity - 1, -1, -1))
        self._idle = EvictionQueue(self.replacement)

    def match(self, node_ids: Sequence[str], start: int) -> int:
        """How many of `node_ids[start:]`, in a row from `start`, the tier holds (a prefix lookup
        after the blocks vLLM found on the device)."""
        self.looked_up += len(node_ids) - start
        count = 0
        while start + count < len(node_ids) and node_ids[start + count] in self.nodes:
            count += 1
        return count

    def take_for_load(self, node_ids: Iterable[str], now: float) -> list[int]:
        """The slots of nodes a request loads this step, pinned and scored for it."""
        slots = []
        for node_id in node_ids:
            node = self.nodes[node_id]
            node.pins += 1
            self._idle.discard(node_id)
            node.hits += 1
            node.last_access = now
            node.score += RUN_SCORE + WINDOW_SCORE
            self._changed.add(node_id)
            slots.append(node.slot)
        self.loaded += len(slots)
        return slots

    def take_for_saves(self, nodes: Sequence[tuple[str, int]], now: float) -> list[int]:
        """Slots for nodes requests have just computed, (NodeID, block index in its prompt) (none of
        them held yet), each pinned and scored for its request. When free slots run short, the idle
        nodes CaR's replacement ranks lowest give theirs up, all chosen at once; nodes past what can
        be freed are not kept: the slots returned are those of the first len(result) nodes."""
        short = len(nodes) - len(self._free)
        if short > 0:
            for victim in self._idle.pop(short):
                self._evict(victim)
        slots = []
        for node_id, depth in nodes[:len(self._free)]:
            node = self.nodes[node_id] = HostNode(node_id, self._free.pop(), now, score=RUN_SCORE + WINDOW_SCORE,
                                                  pins=1, depth=depth)
            self._changed.add(node_id)
            self._dropped.discard(node_id)
            slots.append(node.slot)
        self.saved += len(slots)
        return slots

    def use(self, node_id: str, now: float) -> bool:
        """A running request uses a node the tier already holds (it found it on the device): scored
        for it. False when the tier does not hold it."""
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.last_access = now
        node.score += RUN_SCORE + WINDOW_SCORE
        self._rescored(node)
        return True

    def release(self, node_ids: Iterable[str]) -> None:
        """A request that used these nodes has ended."""
        for node_id in node_ids:
            node = self.nodes.get(node_id)
            if node is not None:
                node.score += DONE_SCORE
                self._rescored(node)

    def unpin(self, node_ids: Iterable[str]) -> None:
        for node_id in node_ids:
            node = self.nodes[node_id]
            node.pins -= 1
            if not node.pins:
                self._idle.put(_view(node))

    def _rescored(self, node: HostNode) -> None:
        self._changed.add(node.node_id)
        if not node.pins:
            self._idle.put(_view(node))

    def note_changes(self, node_ids: Iterable[str]) -> None:
        """Journal these again as they are now, held or dropped (telling kvmeta of them failed)."""
        for node_id in node_ids:
            (self._changed if node_id in self.nodes else self._dropped).add(node_id)

    def take_changes(self) -> tuple[list[HostNode], list[str]]:
        """Nodes added or rescored, and those evicted, since the last call (for kvmeta's table)."""
        changed = [self.nodes[i] for i in self._changed if i in self.nodes]
        dropped = sorted(self._dropped)
        self._changed, self._dropped = set(), set()
        return changed, dropped

    def _evict(self, node_id: str) -> None:
        node = self.nodes.pop(node_id)
        self._free.append(node.slot)
        self._changed.discard(node_id)
        self._dropped.add(node_id)
        self.evicted += 1


def _view(node: HostNode) -> CachedBlockView:
    return CachedBlockView(node_id=node.node_id, last_access=node.last_access, hits=node.hits,
                           score=float(node.score), tier="cxl", depth=node.depth)
