"""What an allocation policy reads and answers, once per engine step.

Allocation here is a ledger, as in CacheOpt 3.3: a request is *allotted* a_i tokens of KV (its
allocation) while the engine hands it physical blocks only as its tokens arrive. The KV no running
request is allotted, less the global reservation, is A'_kvc (`unallocated`); a policy grants from it,
and a request that outgrows its allocation gets more on demand, from the reservation, or by
preempting someone. A request whose allocation is None has none: it takes blocks as it goes (vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..views import RequestView


@dataclass(frozen=True, slots=True)
class AllocationParams:
    """CacheOpt's knobs, defaults from its section 5 (block 8 tokens, m = 2, 8 reserved blocks)."""

    block_tokens: int = 8           # B: a critical request's basic extra KV, and one on-demand step
    embed_buffer: int = 8           # b: tokens kept between a host's growth and an embedded guest (3.3.1)
    proactive_iterations: int = 2   # m: unfulfilled requests predicted to end within m steps are topped up (3.3.3)
    reserved_blocks: int = 8        # the global reservation, in the engine's blocks per layer (3.3.3)
    epsilon_s: float = 0.005        # epsilon: RT - T_I^max below it makes a request critical (3.3.2)
    no_slo_rt_s: float = 10.0       # the remaining time counted for a request without an SLO

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.embed_buffer < 0 or self.proactive_iterations < 0 or self.reserved_blocks < 0:
            raise ValueError("block_tokens must be >= 1; embed_buffer, proactive_iterations, reserved_blocks >= 0")
        if self.no_slo_rt_s <= 0:
            raise ValueError(f"no_slo_rt_s must be > 0, got {self.no_slo_rt_s}")


@dataclass(frozen=True, slots=True)
class AllocationInput:
    waiting: Sequence[RequestView]   # in the prefill admission policy's order
    running: Sequence[RequestView]   # with their allocations
    unallocated: int                 # A'_kvc, in tokens: device KV nobody is allotted, the reservation excluded
                                     # (included while no request holds a place: nobody would free any)
    token_budget: int                # tokens this step can still compute once the running requests have theirs
    max_iteration_s: float           # T_I^max, the longest recent step
    now: float                       # engine clock, seconds
    params: AllocationParams = AllocationParams()


@dataclass(frozen=True, slots=True)
class Grant:
    """A request's allocation from this step on. For a waiting request, an offer to join the batch."""

    request_id: str
    tokens: int | None               # a_i; None: no allocation, it takes blocks as it goes
    hosts: tuple[tuple[str, int], ...] = ()  # embedded: (running request, tokens of its allotted but unused KV) (3.3.1)
    lender: str | None = None        # when this running request ends, `lent` of its allocation passes here (3.3.2)
    lent: int = 0


@dataclass(frozen=True, slots=True)
class AllocationPlan:
    grants: tuple[Grant, ...] = ()   # running requests' new allocations, then waiting ones in admission order
    preempt: tuple[str, ...] = ()    # running requests to preempt now: their allocation ran out and will not grow
    preempt_tokens: int = 0          # then free this much of A'_kvc by preemption (D_kvc > A'_kvc)
    critical: frozenset[str] = field(default_factory=frozenset)  # never preempted to make that room


def critical_time(request: RequestView, now: float, params: AllocationParams) -> float:
    """RT: seconds left to the request's next deadline, its first token's (SLO_tft from arrival) while
    it has none, else its next token's (SLO_tbt from the last)."""
    if request.last_token_at is None:
        slo, start = request.ttft_slo_ms, request.arrival
    else:
        slo, start = request.tbt_slo_ms, request.last_token_at
    return params.no_slo_rt_s if slo is None else start + slo / 1e3 - now


def demand(request: RequestView, params: AllocationParams) -> int:
    """M_i = s_i^p + s_i^o in tokens; a request that outran its estimate demands B past what it has."""
    total = request.prompt_len + request.estimated_output_len
    return total if total >= request.num_tokens else request.num_tokens + params.block_tokens


def spare_allotment(allocation: int, num_tokens: int, params: AllocationParams) -> int:
    """Allotted KV a running request can give back and still have B tokens ahead of what it has."""
    return max(0, allocation - (num_tokens + params.block_tokens))


def exhausted(request: RequestView) -> bool:
    """A running request whose allocation cannot hold its next step's KV."""
    return request.allocation is not None and request.allocation < request.num_tokens
