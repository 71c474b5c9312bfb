"""Allocation by estimated length, the baselines CacheOpt compares with: RLP [7] allots each request
its prompt and estimated output (the predictor's estimate carries RLP's fixed padding) and a request
that outgrows it gets B more tokens at a time; S^3 [8] allots the same way (its estimate is the upper
bound of a length bucket) and doubles a request's allocation when it runs out. Both admit in the
admission policy's order (FCFS) while the unallocated KV covers the next request's whole estimate."""

from __future__ import annotations

from collections.abc import Callable

from ..length.predictors import s3_doubled_allocation
from ..views import RequestView
from .plan import AllocationInput, AllocationParams, AllocationPlan, Grant, demand, exhausted


def estimate(batch: AllocationInput) -> AllocationPlan:
    return _by_estimate(batch, lambda r, params: demand(r, params))


def s3(batch: AllocationInput) -> AllocationPlan:
    def doubled(r: RequestView, params: AllocationParams) -> int:
        """The output part of the allocation doubled, as S^3 reallocates after a failure."""
        output = s3_doubled_allocation(max(1, r.allocation - r.prompt_len), r.max_tokens)
        return max(r.prompt_len + output, r.num_tokens)
    return _by_estimate(batch, doubled)


def _by_estimate(batch: AllocationInput, grown: Callable[[RequestView, AllocationParams], int]) -> AllocationPlan:
    left, grants = batch.unallocated, []
    for request in filter(exhausted, batch.running):
        tokens = grown(request, batch.params)
        if tokens - request.allocation <= left:
            left -= tokens - request.allocation
            grants.append(Grant(request.request_id, tokens))
    for request in batch.waiting:
        tokens = demand(request, batch.params)
        if tokens > left:
            break
        left -= tokens
        grants.append(Grant(request.request_id, tokens))
    return AllocationPlan(grants=tuple(grants))
