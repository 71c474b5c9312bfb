"""vLLM's block allocation: no allocation ahead, a request takes blocks as its tokens arrive and
every waiting request is offered a place in the admission policy's order."""

from __future__ import annotations

from .plan import AllocationInput, AllocationPlan, Grant


def block_at_a_time(batch: AllocationInput) -> AllocationPlan:
    return AllocationPlan(grants=tuple(Grant(r.request_id, None) for r in batch.waiting))
