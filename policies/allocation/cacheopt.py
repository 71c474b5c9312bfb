"""CacheOpt's SLO-aware batching and KV allocation (3.3), in tokens, as pure functions.

Each step: (1) critical requests, the waiting ones about to miss their TTFT SLO (N_w) and the
returned ones that used up their allocation and are about to miss their TBT SLO (N_r), get their
basic requirement first (s_i^p + B, or B), embedded in another request's allotted but unused KV
where they fit (3.3.1), else from the unallocated KV, preempting to cover D_kvc; (2) what is left
goes to everyone in the batch (critical, the other returned requests N'_r, the waiting requests the
token budget reaches N'_w, and the unfulfilled requests predicted to end within m steps, 3.3.3) up to
each one's demand M_i, cut by weight when it does not stretch (the amortised cut); a request cut short
borrows the allocation of a running request that ends shortly before it would run out (lending).

Before preempting for D_kvc, kvmesh first takes the shortfall back from running requests' allotted
but unused KV (most unused first, each keeping B tokens ahead; they grow on demand again): the
paper's aim is to reuse such KV to avoid preemptions, and a preemption frees nothing else that
trimming could not.

`cacheopt_guarded` adds a victim guard the paper does not have: D_kvc never preempts a running
request whose own next deadline is within RECOVERY_STEPS x T_I^max, since preempted it would miss
that deadline by at least a step, trading its SLO for the critical request's. It pays where a
preemption is a recompute (vLLM: past capacity, 3 preemptions and 548 ms P99 TTFT against 43 and
1,032 ms as printed) and not where the engine can swap (the native engine's sweet spot: ShareGPT
and BookCorpus P99 TTFT 3.3x and 2.2x worse guarded, in one run each); docs/benchmarks.md.

Reading of the amortised cut. The paper states its intent ("a request with a looser SLO and a longer
predicted output length should have a higher KVC demand cut") and defines E_kvc = sum M_i - A'_kvc
(Table 2), but prints A_i = A'_kvc * w_i / sum w. kvmesh cuts E_kvc by the weights, cut_i = E_kvc *
w_i / sum w with w_i = RT_i / sum RT * s_i^p / sum s^p as printed, so the looser and longer a request,
the more it gives up, and no request is allotted more than it asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..views import RequestView
from .plan import (AllocationInput, AllocationParams, AllocationPlan, Grant, critical_time, demand, exhausted,
                   spare_allotment)

MIN_RT_S = 1e-3  # a request already past its deadline still weighs something in the cut
RECOVERY_STEPS = 2  # a preempted request needs at least this many steps to get its next token out


def embedding_start(host_allocation: int, host_used: int, guest_prompt: int, guest_output: int,
                    buffer: int) -> int | None:
    """3.3.1: the token offset s_0 = a_j - (u_j + s_i^o) - b in host r_j's allotted KV where guest r_i
    can live, or None unless a_j - (u_j + s_i^o) - (s_i^p + s_i^o) >= b (after s_i^o steps the host
    has not reached the guest's space, b tokens to spare)."""
    ahead = host_allocation - (host_used + guest_output)
    if ahead - (guest_prompt + guest_output) < buffer:
        return None
    return ahead - buffer


def choose_host(guest: RequestView, hosts: Mapping[str, tuple[int, int]], params: AllocationParams) -> str | None:
    """The running request (id -> (a_j, u_j)) the guest can be embedded in with the least allotted
    but unused KV, to waste the least; None if it fits in none."""
    fits = [(allocation - used, host) for host, (allocation, used) in hosts.items()
            if embedding_start(allocation, used, guest.num_tokens, guest.estimated_output_len, params.embed_buffer)
            is not None]
    return min(fits)[1] if fits else None


def spread_hosts(guest: RequestView, hosts: Mapping[str, tuple[int, int]], params: AllocationParams
                 ) -> list[tuple[str, int]] | None:
    """3.3.1 over several hosts: each running request r_j (id -> (a_j, u_j)) offers the part of its
    allotment it will not reach while the guest runs, a_j - (u_j + s_i^o) - b; when together they
    cover the guest's s_i^p + s_i^o, it takes from those offering most first. None if they cannot."""
    need = guest.num_tokens + guest.estimated_output_len
    offers = sorted(((max(0, allocation - (used + guest.estimated_output_len) - params.embed_buffer), host)
                     for host, (allocation, used) in hosts.items()), reverse=True)
    if sum(offer for offer, _ in offers) < need:
        return None
    taken = []
    for offer, host in offers:
        taken.append((host, min(offer, need)))
        need -= taken[-1][1]
        if need == 0:
            return taken
    return None


def critical_demand(critical_waiting: Sequence[RequestView], critical_returned: Sequence[RequestView],
                    params: AllocationParams) -> int:
    """D_kvc = sum over N_w of (s_i^p + B) + |N_r| * B."""
    return sum(r.num_tokens + params.block_tokens for r in critical_waiting) + len(critical_returned) * params.block_tokens


def cut_weights(remaining_times: Sequence[float], prompt_lens: Sequence[int]) -> list[float]:
    """w_i = RT_i / sum RT * s_i^p / sum s^p."""
    total_rt, total_prompt = sum(remaining_times), sum(prompt_lens)
    return [rt / total_rt * p / total_prompt for rt, p in zip(remaining_times, prompt_lens)]


def amortised_cut(needs: Sequence[int], floors: Sequence[int], weights: Sequence[float], available: int) -> list[int]:
    """Tokens for each request when sum(needs) exceeds `available`: the excess E_kvc is cut in
    proportion to the (positive) weights, no request below its floor (a cut that would go past a floor stops
    there and the rest of the excess is shared among the others by weight). Rounded down, so the
    total never exceeds `available`."""
    if sum(floors) > available:
        raise ValueError(f"the floors ({sum(floors)} tokens) exceed the {available} tokens available")
    if sum(needs) <= available:
        return list(needs)
    give = [float(n) for n in needs]
    open_ = {i for i, (n, f) in enumerate(zip(needs, floors)) if n > f}
    excess = sum(needs) - available
    while excess > 1e-9 and open_:
        total = sum(weights[i] for i in open_)
        share = {i: excess * weights[i] / total for i in open_}
        capped = {i for i in open_ if give[i] - share[i] <= floors[i]}
        if not capped:
            for i in open_:
                give[i] -= share[i]
            break
        for i in capped:  # these stop at their floor; the others share what they could not give
            excess -= give[i] - floors[i]
            give[i] = floors[i]
        open_ -= capped
    return [int(g) for g in give]


def cacheopt(batch: AllocationInput) -> AllocationPlan:
    return _plan(batch, guard_victims=False)


def cacheopt_guarded(batch: AllocationInput) -> AllocationPlan:
    """CacheOpt with kvmesh's victim guard: D_kvc never preempts a request whose own deadline is near."""
    return _plan(batch, guard_victims=True)


def _plan(batch: AllocationInput, guard_victims: bool) -> AllocationPlan:
    params, block = batch.params, batch.params.block_tokens
    rt = {r.request_id: critical_time(r, batch.now, params) for r in (*batch.waiting, *batch.running)}

    def urgent(r: RequestView) -> bool:
        """Critical: it must run in this step to meet its SLO, and still can (one already missed
        is not, or under overload the missed ones would preempt each other in turn)."""
        return 0 < rt[r.request_id] < batch.max_iteration_s + params.epsilon_s

    waiting = sorted(batch.waiting, key=lambda r: rt[r.request_id])
    returned = [r for r in batch.running if exhausted(r)]
    critical_w = [r for r in waiting if urgent(r)]
    critical_r = [r for r in returned if urgent(r)]
    budget = batch.token_budget - sum(r.num_tokens for r in critical_w)
    chosen_w = []
    for r in waiting:  # N'_w: the waiting requests the token budget reaches, least remaining time first
        if budget <= 0:
            break
        if r not in critical_w:
            chosen_w.append(r)
            budget -= r.num_tokens
    hosts = {r.request_id: (r.allocation, r.num_computed) for r in batch.running
             if r.allocation is not None and r.tier == "device" and not exhausted(r)}
    embedded: dict[str, tuple[tuple[str, int], ...]] = {}

    def embed(r: RequestView) -> bool:
        """In one host as the paper does, else spread over several; the hosts' allotted KV shrinks
        by what the guest takes until the guest ends."""
        host = choose_host(r, hosts, params)
        taken = [(host, demand(r, params))] if host is not None else spread_hosts(r, hosts, params)
        for host_id, tokens in taken or ():
            allocation, used = hosts[host_id]
            hosts[host_id] = (allocation - tokens, used)
        if taken:
            embedded[r.request_id] = tuple(taken)
        return bool(taken)

    # (1) critical requests: their basic requirement, embedded first, largest first.
    critical = sorted(critical_w + critical_r, key=lambda r: r.num_tokens if r in critical_w else 0, reverse=True)
    placed_w = [r for r in critical if r in critical_w and not embed(r)]
    d_kvc = critical_demand(placed_w, critical_r, params)
    allotted = {r.request_id: r.num_tokens + block for r in placed_w}
    allotted |= {r.request_id: r.allocation + block for r in critical_r}
    trimmed = _trim(batch.running, hosts, d_kvc - batch.unallocated, {r.request_id for r in critical}, params)
    short = d_kvc - batch.unallocated - sum(hosts[i][0] - tokens for i, tokens in trimmed.items())
    left = max(0, -short)

    # (2) the rest, to everyone in the batch up to their demand.
    others_w = [r for r in chosen_w if not embed(r)]
    proactive = [r for r in batch.running if r.allocation is not None and not exhausted(r) and r.request_id not in trimmed
                 and r.allocation < demand(r, params) and r.predicted_remaining_tokens <= params.proactive_iterations]
    fill = [*placed_w, *critical_r, *[r for r in returned if r not in critical_r], *proactive]
    while True:  # a non-critical waiting request joins only if its basic requirement fits
        members = fill + others_w
        current = [allotted.get(r.request_id, r.allocation or 0) for r in members]
        floors = [r.num_tokens + block if r in others_w else c for r, c in zip(members, current)]
        if sum(floors) <= left + sum(current) or not others_w:
            break
        others_w.pop()
    needs = [max(d, c) for d, c in zip((demand(r, params) for r in members), current)]
    floors = [min(f, n) for f, n in zip(floors, needs)]
    extra_needs = [n - c for n, c in zip(needs, current)]
    extra_floors = [max(0, f - c) for f, c in zip(floors, current)]
    weights = cut_weights([max(rt[r.request_id], MIN_RT_S) for r in members], [max(1, r.prompt_len) for r in members])
    extras = amortised_cut(extra_needs, extra_floors, weights, left) if members else []

    lenders = {r.request_id: r for r in batch.running
               if r.allocation is not None and not exhausted(r) and r.request_id not in trimmed}
    grants: dict[str, Grant] = {i: Grant(i, tokens) for i, tokens in trimmed.items()}
    for r, have, extra, need in zip(members, current, extras, needs):
        tokens = have + extra
        lender = _lender(r, tokens, need - tokens, lenders) if tokens < need else None
        if lender is not None:
            del lenders[lender.request_id]
        grants[r.request_id] = Grant(r.request_id, tokens, lender=lender and lender.request_id,
                                     lent=need - tokens if lender else 0)
    for r in waiting:
        if r.request_id in embedded:
            grants[r.request_id] = Grant(r.request_id, demand(r, params), hosts=embedded[r.request_id])
    running_ids = {r.request_id for r in batch.running}
    order = [g for g in grants.values() if g.request_id in running_ids]
    order += [grants[r.request_id] for r in waiting if r.request_id in grants]
    # A victim recomputed (or swapped back) misses its next token by at least a step: one whose own
    # deadline is that close would only trade its SLO for the critical request's.
    tight = {r.request_id for r in batch.running
             if guard_victims and rt[r.request_id] < RECOVERY_STEPS * batch.max_iteration_s}
    return AllocationPlan(grants=tuple(order), preempt_tokens=max(0, short),
                          critical=frozenset(r.request_id for r in critical) | tight)


def _trim(running: Sequence[RequestView], hosts: Mapping[str, tuple[int, int]], short: int, keep: set[str],
          params: AllocationParams) -> dict[str, int]:
    """Allocations cut back to cover `short` tokens of D_kvc before anyone is preempted: the running
    requests with the most allotted but unused KV give it up first, each keeping B tokens ahead of
    what it has (it grows on demand again later). Returns the new allocations by request id."""
    trimmed: dict[str, int] = {}
    spare = {r.request_id: spare_allotment(hosts[r.request_id][0], r.num_tokens, params) for r in running
             if r.request_id in hosts and r.request_id not in keep}
    for request_id in sorted(spare, key=spare.get, reverse=True):
        if short <= 0 or spare[request_id] <= 0:
            break
        take = min(spare[request_id], short)
        trimmed[request_id] = hosts[request_id][0] - take
        short -= take
    return trimmed


def _lender(borrower: RequestView, allotted: int, short: int, lenders: Mapping[str, RequestView]) -> RequestView | None:
    """The running request that ends (by its prediction) last before the borrower would run out of
    its `allotted` tokens, with an allocation of at least `short` tokens to pass on."""
    steps_left = allotted - borrower.num_tokens
    fits = [r for r in lenders.values() if r.request_id != borrower.request_id and r.allocation >= short
            and r.predicted_remaining_tokens <= steps_left]
    return max(fits, key=lambda r: r.predicted_remaining_tokens, default=None)
