"""Allocation by estimated length, the baselines CacheOpt compares with (its section 2.1). RLP [7]
allots each request its prompt and estimated output (the predictor's estimate carries RLP's fixed
padding); S^3 [8] allots the same way (its estimate is the upper bound of a length bucket). Both admit
in the admission policy's order (FCFS) while the unallocated KV covers the next request's whole
estimate, and preempt a request that runs out of its allocation; it comes back with the estimate
once more (RLP) or with its output allotment doubled (S^3), up to max_tokens."""

from __future__ import annotations

from collections.abc import Callable

from ..length.predictors import s3_doubled_allocation
from ..views import RequestView
from .plan import AllocationInput, AllocationParams, AllocationPlan, Grant, exhausted


def estimate(batch: AllocationInput) -> AllocationPlan:
    return _by_estimate(batch, lambda r: r.estimated_output_len * (r.preemptions + 1))


def s3(batch: AllocationInput) -> AllocationPlan:
    def doubled(r: RequestView) -> int:
        output = r.estimated_output_len
        for _ in range(r.preemptions):
            output = s3_doubled_allocation(output, r.max_tokens)
        return output
    return _by_estimate(batch, doubled)


def allotment(request: RequestView, output: int, params: AllocationParams) -> int:
    """The prompt and `output` tokens (at most max_tokens), and B past what the request has."""
    return max(request.prompt_len + min(output, request.max_tokens), request.num_tokens + params.block_tokens)


def _by_estimate(batch: AllocationInput, output: Callable[[RequestView], int]) -> AllocationPlan:
    left, grants = batch.unallocated, []
    for request in batch.waiting:
        tokens = allotment(request, output(request), batch.params)
        if tokens > left:
            break
        left -= tokens
        grants.append(Grant(request.request_id, tokens))
    return AllocationPlan(grants=tuple(grants),
                          preempt=tuple(r.request_id for r in batch.running if exhausted(r)))
