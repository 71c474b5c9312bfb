"""CacheOpt 3.3's allocation ledger over an engine's device blocks, kept by both backends' schedulers
(the native one and KVMeshScheduler on vLLM) and by the simulator: bookkeeping over the requests
given to it, no I/O, so it sits with the allocation policies whose grants it applies.

A request is *allotted* tokens of KV (its allocation, policies/allocation/plan.py) while it takes
physical blocks only as its tokens arrive. What the ledger promises is the part of each allocation
not yet backed by blocks; the free blocks less those promises are the headroom, and the headroom
less the global reservation is A'_kvc, what an allocation policy may grant. A request that outgrows
its allocation gets B tokens more on demand: from A'_kvc, else from the reservation, else out of
other requests' allotted but unused KV (3.3.3); only when none of these has room is it preempted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from ..views import blocks_for
from .plan import AllocationParams, Grant, spare_allotment


class Allottee(Protocol):
    """A request as the ledger sees it; `allocation`, `passes` and `guests` are the ledger's to change."""

    request_id: str
    allocation: int | None        # tokens allotted; None: blocks as it goes, outside the ledger
    passes: list[tuple[str, int]]  # allocation handed on when it ends: to its host, or a borrower
    guests: list[str]             # requests embedded in its allotted KV

    @property
    def num_tokens(self) -> int: ...

    @property
    def blocks_per_layer(self) -> int: ...

    @property
    def tier(self) -> str: ...


class Ledger:
    def __init__(self, params: AllocationParams, block_size: int, free_blocks: Callable[[], int],
                 holders: Callable[[], Iterable[Allottee]]):
        """`free_blocks`: the device's free blocks per layer now; `holders`: the requests that hold
        a place on the engine (running, or with blocks for KV on its way)."""
        self.params = params
        self.block_size = block_size
        self.free_blocks = free_blocks
        self.holders = holders
        self.grown = {"unallocated": 0, "reserved": 0, "reclaimed": 0}  # all time, by where from

    def headroom(self) -> int:
        """Device blocks per layer that are free and allotted to nobody (the reservation included)."""
        return self.free_blocks() - sum(self.promised(r, r.allocation) for r in self.holders())

    def unallocated_tokens(self) -> int:
        """A'_kvc: tokens of device KV allotted to nobody, the global reservation left out."""
        return max(0, self.headroom() - self.params.reserved_blocks) * self.block_size

    def reserved_from(self, request: Allottee | None = None) -> int:
        """The blocks per layer of the global reservation kept from `request`: all of them while anyone
        else holds a place, none when nobody does (nobody would ever free KV for it then)."""
        return self.params.reserved_blocks if any(r is not request for r in self.holders()) else 0

    def grantable_tokens(self) -> int:
        """What an allocation policy may grant now: A'_kvc, or, with nobody holding a place, all the
        headroom, the reservation too (reserved_from)."""
        return max(0, self.headroom() - self.reserved_from()) * self.block_size

    def promised(self, request: Allottee, allocation: int | None) -> int:
        """Blocks per layer `allocation` promises the request beyond those it holds."""
        if allocation is None or request.tier != "device":
            return 0
        return max(0, blocks_for(allocation, self.block_size) - request.blocks_per_layer)

    def allot(self, request: Allottee, grant: Grant) -> bool:
        """Apply a grant if the ledger covers it: out of its hosts' allotted KV, or out of the
        unallocated; False, and nothing changed, if it does not."""
        if grant.tokens is None:
            return True
        if grant.hosts:
            hosts = [(self._holder(host_id), tokens) for host_id, tokens in grant.hosts]
            if any(h is None or h.allocation is None or h.allocation - tokens < h.num_tokens for h, tokens in hosts):
                return False
            for host, tokens in hosts:
                host.allocation -= tokens
                host.guests.append(request.request_id)
                request.passes.append((host.request_id, tokens))
        else:
            more = self.promised(request, grant.tokens) - self.promised(request, request.allocation)
            room = max(0, self.headroom() - self.reserved_from(request)) * self.block_size
            if more > 0 and more * self.block_size > room:
                return False
        request.allocation = grant.tokens
        lender = self._holder(grant.lender) if grant.lender else None
        if lender is not None:
            lender.passes.append((request.request_id, grant.lent))
        return True

    def grow(self, request: Allottee, needed: int) -> bool:
        """The request needs KV for `needed` tokens, past its allocation: B tokens more at a time,
        from where there is room (see the module's docstring); False, and nothing changed, if none."""
        block = self.params.block_tokens
        grown = request.allocation + -(-(needed - request.allocation) // block) * block
        more = self.promised(request, grown) - self.promised(request, request.allocation)
        if more * self.block_size <= self.unallocated_tokens():
            source = "unallocated"
        elif more <= self.headroom():
            source = "reserved"
        elif self._reclaim(more - self.headroom(), keep=request):
            source = "reclaimed"
        else:
            return False
        self.grown[source] += 1
        request.allocation = grown
        return True

    def _reclaim(self, blocks: int, keep: Allottee) -> bool:
        """Cut back other requests' allotted but unused KV, most unused first (each keeps B tokens
        ahead and grows again later), until `blocks` blocks per layer are allotted to nobody; False
        (nothing changed) if they cannot give it."""
        spare = [(spare_allotment(r.allocation, r.num_tokens, self.params), r) for r in self.holders()
                 if r is not keep and r.allocation is not None and r.tier == "device"]
        cuts: list[tuple[Allottee, int]] = []
        goal = self.headroom() + blocks
        for tokens, request in sorted((s for s in spare if s[0] > 0), key=lambda s: s[0], reverse=True):
            cuts.append((request, request.allocation))
            request.allocation -= tokens
            if self.headroom() >= goal:
                return True
        for request, allocation in cuts:
            request.allocation = allocation
        return False

    def settle(self, request: Allottee) -> None:
        """The request ends or loses its place: hand on the allocation it owes, drop its own."""
        for request_id, tokens in request.passes:
            beneficiary = self._holder(request_id)
            if beneficiary is not None and beneficiary.allocation is not None:
                beneficiary.allocation += tokens
        request.allocation, request.passes, request.guests = None, [], []

    def _holder(self, request_id: str) -> Allottee | None:
        return next((r for r in self.holders() if r.request_id == request_id), None)
