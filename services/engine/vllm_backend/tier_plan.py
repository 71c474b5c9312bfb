"""The cxl tier's scheduler side in vLLM's connector (CaR, docs/vllm.md): which blocks of a request
the host tier holds after vLLM's own device hit (loaded before each layer runs, instead of computed),
which full blocks a step completes that the tier does not hold yet (saved after each layer runs),
and the table's pins and scores between. host_table.py decides what the tier keeps; host_tier.py
moves the bytes on the worker side."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.libs.kvmeta.nodeid import node_ids

from .host_table import HostTable

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class TierRequest:
    """Scheduler side: a request the cxl tier serves, from its first schedule to its end."""

    request: Request
    node_ids: list[str] = field(default_factory=list)   # of its full blocks so far
    used: set[str] = field(default_factory=set)         # nodes scored for it
    walked: int = 0                                     # full blocks already loaded, saved or scored
    hit: tuple[int, int] = (0, 0)                       # its last lookup: (first block, blocks in the tier)


class TierPlan:
    def __init__(self, table: HostTable, block_size: int, model: str):
        """`model` seeds the NodeIDs of cached blocks (the model name routing uses)."""
        self.table, self.block_size, self.model = table, block_size, model
        self._requests: dict[str, TierRequest] = {}
        self._loads: tuple[list[int], list[int]] = ([], [])   # this step's (slots, blocks), so far
        self._pinned: list[str] = []

    def step(self, scheduler_output: SchedulerOutput, block_ids_of: Callable[[str], list[int]]
             ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """The step's (slots, blocks) to load before each layer and (blocks, slots) to save after it;
        `block_ids_of` gives a request's device blocks."""
        loads, saves = self._loads, self._saves_of(scheduler_output, block_ids_of)
        self.table.unpin(self._pinned)
        self._loads, self._pinned = ([], []), []
        return loads, saves

    def finished(self, request_id: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self.table.release(tracked.used)

    def lookup(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after vLLM's own device hit whose blocks the cxl tier holds, in a row (whole blocks
        but the last token's, which vLLM computes to sample from)."""
        tracked = self._requests.get(request.request_id) or TierRequest(request)
        self._requests[request.request_id] = tracked
        ids = self._node_ids(tracked)[:(request.num_tokens - 1) // self.block_size]
        first = num_computed_tokens // self.block_size
        tracked.hit = first, self.table.match(ids, first)
        return tracked.hit[1] * self.block_size

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._requests.setdefault(request.request_id, TierRequest(request))
        first, count = tracked.hit
        tracked.hit = (0, 0)
        if num_external_tokens <= 0 or (request.kv_transfer_params or {}).get("remote_address"):
            return
        count = min(count, num_external_tokens // self.block_size)
        loading = tracked.node_ids[first:first + count]
        slots = self.table.take_for_load(loading, time.monotonic())
        tracked.used.update(loading)
        self._pinned += loading
        self._loads[0].extend(slots)
        self._loads[1].extend(blocks.get_block_ids()[0][first:first + count])

    def _saves_of(self, scheduler_output: SchedulerOutput, block_ids_of: Callable[[str], list[int]]
                  ) -> tuple[list[int], list[int]]:
        """(blocks, slots): every full block this step completes that the tier does not hold yet, the
        slots taken in one go; blocks it holds already are scored for the request."""
        now = time.monotonic()
        new: dict[str, tuple[int, int]] = {}              # node -> the block that computes it, and its index
        owners: dict[str, list[TierRequest]] = {}         # requests computing a new node this step
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            full = min(request.num_computed_tokens + scheduled, request.num_tokens) // self.block_size
            if full <= tracked.walked:
                continue
            ids = self._node_ids(tracked, full)
            block_ids = block_ids_of(request_id)
            for index in range(tracked.walked, full):
                node_id = ids[index]
                if node_id in tracked.used:
                    continue
                tracked.used.add(node_id)
                if node_id in owners:   # another request computes it this step too
                    owners[node_id].append(tracked)
                elif not self.table.use(node_id, now):
                    new[node_id] = block_ids[index], index
                    owners[node_id] = [tracked]
            tracked.walked = full
        wanted = list(new)
        slots = self.table.take_for_saves([(node_id, new[node_id][1]) for node_id in wanted], now)
        kept = wanted[:len(slots)]
        for node_id in wanted[len(slots):]:   # every slot pinned this step: not kept
            for tracked in owners[node_id]:
                tracked.used.discard(node_id)
        for node_id in kept:
            for _ in owners[node_id][1:]:   # the other requests that computed it: scored as its users
                self.table.use(node_id, now)
        self._pinned += kept
        return [new[node_id][0] for node_id in kept], slots

    def _node_ids(self, tracked: TierRequest, blocks: int | None = None) -> list[str]:
        """The request's NodeIDs, extended to `blocks` full blocks (all it has when None)."""
        tokens = tracked.request.all_token_ids
        blocks = len(tokens) // self.block_size if blocks is None else blocks
        have = len(tracked.node_ids)
        if blocks > have:
            tracked.node_ids += node_ids(tokens[have * self.block_size:blocks * self.block_size], self.block_size,
                                         self.model, tracked.node_ids[-1] if have else None)
        return tracked.node_ids
