"""The iteration scheduler: each step, which requests compute how many tokens (continuous
batching at iteration level, as in Orca and vLLM), with chunked prefill under a token budget. The
native engine runs it (services/engine/native/scheduler.py) and so does the simulator (sim/engine.py):
it does no I/O, it moves requests between queues and calls the block accounting, the policies and
the ledger, through the seams of seams.py.

The decisions are the policies' (policies/): who is admitted, how much KV a request is allotted, who
is preempted and how, what the prefix cache drops. This file carries them out, in the order of
ARCHITECTURE.md: running requests first (decodes and unfinished prefill chunks), then swapped-out
ones coming back, then waiting ones in admission order.

Allocation is a ledger (ledger.py): with any policy but vLLM's block_at_a_time, each step starts
with the policy's plan for the batch; a request's blocks still come as its tokens do, but only
within its allocation, grown on demand as the ledger allows, and preempted only when it cannot grow.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from ..allocation import AllocationInput, AllocationParams, AllocationPlan, Grant, block_at_a_time
from ..allocation.ledger import Ledger
from ..cache.node_table import PrefixHit
from ..offload import decodes_next, interleaved
from ..offload import none as no_offload
from ..offload.plan import OffloadInput, OffloadParams
from ..views import RequestView, blocks_for
from .hooks import Policies
from .seams import Blocks, LayeredBlocks, LayeredRequest, Reuse, Schedulable
from .status import Status
from .view_list import ViewList


@dataclass(frozen=True)
class ScheduledChunk:
    request: Schedulable
    num_tokens: int     # tokens whose KV this step computes

    @cached_property  # read by the runner and the engine, before the step moves num_computed on
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so a new one is sampled."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass
class Plan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[tuple[Schedulable, str]] = field(default_factory=list)
    pulls: list[Schedulable] = field(default_factory=list)  # decode role: given blocks, their KV to pull now
    # LayerKV: device blocks lent for this step's staging area, its two halves (the engine gives them back).
    staging: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))


class Scheduler:
    def __init__(self, blocks: Blocks | LayeredBlocks, policies: Policies, max_num_seqs: int, token_budget: int,
                 allocation: AllocationParams = AllocationParams(), staging_cap: int = 0,
                 offload: OffloadParams = OffloadParams(), reuse: Reuse | None = None, chunked_prefill: bool = True):
        self.blocks = blocks
        self.policies = policies
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        # LayerKV: the most blocks a staged layer of a step may use (0: no layer-wise offloading), and
        # how many this step's chunks use. A step's staging area is lent from the device tier's free
        # blocks, two of these a block: staged layers alternate between two halves.
        self.staging_cap = staging_cap
        self.offload = offload
        self.reuse = reuse  # CaR: the Shuffled Window, scores and prefetch (reuse.py)
        # False: vLLM v0's default scheduler, a peer's baseline (_schedule_whole_prompts); not with LayerKV.
        self.chunked_prefill = chunked_prefill
        self._staged = 0
        self._staging_waits = False  # a running request found no staging room last step: it goes first
        # Request layers put in the cxl tier (admitted, forecast) or brought back (restored), all time.
        self.layers_offloaded = {"admitted": 0, "forecast": 0, "restored": 0}
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []
        self.swapped: deque[Schedulable] = deque()
        self.pulling: list[Schedulable] = []
        self.iteration_s: deque[float] = deque(maxlen=256)  # recent step times, for T_I^max
        self.ledger = Ledger(allocation, blocks.block_size, lambda: blocks.free("device") // blocks.num_layers,
                             lambda: (*self.running, *self.pulling))

    @property
    def layered(self) -> bool:
        """Whether layer-wise offloading is on: a layer_offload policy and a staging area to run it in."""
        return self.staging_cap > 0 and self.policies.layer_offload is not no_offload

    @property
    def restores_decodes(self) -> bool:
        """Whether a prefilled request's offloaded layers come back once before it decodes (LayerKV 4),
        rather than being staged every step."""
        return self.layered and self.offload.decode_offloaded == "restore"

    @property
    def allots_ahead(self) -> bool:
        """Whether the allocation policy in force allots KV ahead (every one but vLLM's)."""
        return self.policies.kv_allocation is not block_at_a_time

    def add(self, request: Schedulable) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Whether a step would do anything (a pull in flight is not the step's work)."""
        return bool(self.waiting or self.running or self.swapped)

    def find(self, request_id: str) -> Schedulable | None:
        for queue in (self.running, self.waiting, self.swapped, self.pulling):
            for request in queue:
                if request.request_id == request_id:
                    return request
        return None

    def finish(self, request: Schedulable, reason: str, release: bool = True) -> None:
        """Take a request out of the engine and, unless told not to, give its blocks back."""
        for queue in (self.running, self.waiting, self.swapped, self.pulling):
            if request in queue:
                queue.remove(request)
        self.blocks.forget_scores(request)   # first: its nodes go idle already rescored, ranked once
        if release:
            self.blocks.release(request)
        self.ledger.settle(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def pulled(self, request: Schedulable, now: float) -> None:
        """The prompt's KV has arrived: the request decodes from its last prompt token on."""
        self.pulling.remove(request)
        request.num_computed = request.num_tokens - 1
        self.blocks.commit(request, now)
        request.status = Status.RUNNING
        self.running.append(request)

    # -- one iteration ----------------------------------------------------------------------------

    def schedule(self, now: float) -> Plan:
        if not self.chunked_prefill:
            return self._schedule_whole_prompts(now)
        plan = Plan()
        self._staged = 0
        retain = self._plan_offload(now) if self.layered else {}
        grants = self._plan_allocation(plan, now) if self.allots_ahead else None
        planned = len(plan.preempted)
        reserved, budget = self._reserve_running(plan, self.token_budget)
        # LayerKV runs prefills first, as vLLM (which it is built on) does: a decode gets the staging
        # area they leave, and Algorithm 1 is what bounds them. Otherwise decodes are staged first, and
        # so are they after one waited a step for staging room: else admissions, each taking the room
        # first, could keep it waiting for ever (and be preempted to make room for it, and come back).
        stage_first = not self.layered or self._staging_waits
        if stage_first:
            budget = self._stage_running(plan, reserved, budget)
        if len(plan.preempted) == planned:  # nobody lost their place for want of blocks
            if not planned:  # room the plan made is for its waiting requests, not for the swapped ones
                budget = self._resume_swapped(plan, budget)
            window = self.reuse is not None and self.waiting and self.policies.names["prefill_admission"] == "car"
            if window:
                self.reuse.before_admission(list(self.waiting), now)
            self._admit_waiting(plan, budget, now, grants, retain)
            if window and self.waiting:
                self.reuse.after_admission(list(self.waiting), self.running, now, self._tpop_s())
        if not stage_first:
            self._stage_running(plan, reserved, budget)
        if self.restores_decodes and not plan.chunks and not plan.preempted:
            self._unblock_restores(plan)
        return plan

    def _schedule_whole_prompts(self, now: float) -> Plan:
        """vLLM v0 without chunked prefill (its default before V1): while nobody is swapped out (new
        requests wait for them), a step prefills the whole prompts of waiting requests that the budget,
        the sequence limit and the blocks take, in order, and the running requests' decodes stall;
        when it admits nobody, it decodes them, preempting when blocks run short, and swaps back in
        only if nobody was preempted."""
        plan = Plan()
        grants = self._plan_allocation(plan, now) if self.allots_ahead else None
        if not self.swapped and not plan.preempted:
            self._admit_waiting(plan, self.token_budget, now, grants, {})
            if plan.chunks:
                return plan
        reserved, budget = self._reserve_running(plan, self.token_budget)
        for request, n in reserved:
            self._chunk(request, n, plan)
        if not plan.preempted:
            self._resume_swapped(plan, budget)
        return plan

    def _tpop_s(self) -> float:
        """CaR's TPOP: the median of recent step times (0 before any: the prefetcher then loads at once)."""
        return statistics.median(self.iteration_s) if self.iteration_s else 0.0

    def _plan_offload(self, now: float) -> dict[str, int]:
        """LayerKV: offload retained layers of running requests when the free-block forecast says
        so; how many layers each waiting request keeps on the device if admitted now."""
        plan = self.policies.layer_offload(OffloadInput(
            admitting=self._admission_order(now), running=[r.view() for r in self.running],
            pool=self.blocks.pool_view(), now=now, params=self.offload))
        by_id = {r.request_id: r for r in self.running}
        for request_id, keep in plan.shrink.items():
            request = by_id.get(request_id)
            on_device = [i for i, layer in enumerate(request.layers) if layer.tier == "device"] if request else []
            if keep >= len(on_device) or request.push is not None:  # a push writes its chunks from the device
                continue
            stay = {on_device[i] for i in interleaved(len(on_device), max(0, keep))}
            if self.blocks.move_layers(request, [i for i in on_device if i not in stay], "cxl"):
                self.layers_offloaded["forecast"] += len(on_device) - len(stay)
        for request_id, layers in plan.restore.items():
            request = by_id.get(request_id)
            offloaded = request.offloaded if request else []
            back = [offloaded[i] for i in interleaved(len(offloaded), min(layers, len(offloaded)))]
            if back and self._can_restore(request, back) and self.blocks.move_layers(request, back, "device"):
                self.layers_offloaded["restored"] += len(back)
        return dict(plan.retain)

    def _can_restore(self, request: LayeredRequest, back: list[int]) -> bool:
        """Whether the request's layers `back` fit on the device without breaking the allocation
        ledger: a request with no layer there starts to be promised its allotment's device blocks."""
        layers = self.blocks.num_layers
        free_after = self.blocks.free("device") - request.blocks_per_layer * len(back)
        promised = self.blocks.free("device") // layers - self.ledger.headroom()
        if request.tier != "device":
            promised += max(0, blocks_for(request.allocation, self.blocks.block_size) - request.blocks_per_layer) \
                if request.allocation is not None else 0
        reserved = self.ledger.reserved_from(request) if self.allots_ahead else 0
        return free_after >= 0 and free_after // layers - promised >= reserved

    def _stages(self, request: Schedulable, n: int) -> bool:
        """Whether a staging area can be lent for this step's `n` tokens of the request (always, for
        a request with every layer on the device): within the cap, from the free device blocks."""
        if not (self.staging_cap and request.offloaded):
            return True
        need = max(request.blocks_per_layer, blocks_for(request.num_computed + n, self.blocks.block_size))
        return self._staged + need <= self.staging_cap and 2 * need <= self.blocks.free("device")

    def _plan_allocation(self, plan: Plan, now: float) -> list[Grant]:
        """Ask the allocation policy for this step's plan, apply its grants to running requests,
        preempt to make the room it asks for; the waiting requests' grants, in order."""
        running_tokens = sum(r.num_tokens - r.num_computed for r in self.running)
        batch = AllocationInput(waiting=self._admission_order(now),
                                running=[r.view() for r in self.running], unallocated=self.ledger.grantable_tokens(),
                                token_budget=self.token_budget - running_tokens,
                                max_iteration_s=max(self.iteration_s, default=0.0), now=now, params=self.ledger.params)
        allocation: AllocationPlan = self.policies.kv_allocation(batch)
        by_id = {r.request_id: r for r in self.running}
        for grant in allocation.grants:
            if grant.request_id in by_id:
                self.ledger.allot(by_id[grant.request_id], grant)
        for victim in [by_id[i] for i in allocation.preempt]:
            self._preempt(victim, plan)
        goal = self.ledger.unallocated_tokens() + allocation.preempt_tokens
        while allocation.preempt_tokens and self.ledger.unallocated_tokens() < goal:
            victims = [r for r in self.running if r.request_id not in allocation.critical]
            if not victims:
                break
            self._preempt(self._pick_victim(victims), plan)
        return [g for g in allocation.grants if g.request_id not in by_id]

    def _reserve_running(self, plan: Plan, budget: int) -> tuple[list[tuple[Schedulable, int]], int]:
        """Blocks for this step's tokens of each running request, in order, preempting by the policy
        when they run short; the requests served and their token counts, and the budget left. One
        whose staging area does not fit even now (the free blocks only shrink as the step is planned)
        takes neither blocks nor budget: it is served with n = 0 and waits for staging room, and those
        behind it get the budget (else it could take all of it, leave nothing running and be
        preempted, step after step)."""
        pending, reserved = list(self.running), []
        while pending and budget > 0:
            request = pending.pop(0)
            if self._awaits_layers(request):  # its layers did not come back: no decode, no blocks this step
                continue
            n = min(request.num_tokens - request.num_computed, budget)
            if not self._stages(request, n):
                reserved.append((request, 0))
                continue
            while not self._reserve(request, n):
                victim = self._pick_victim(self._victims(pending, request) + [request], short=request)
                self._preempt(victim, plan)
                if victim is request:
                    break
                pending.remove(victim)
            if request.status is Status.RUNNING:
                reserved.append((request, n))
                budget -= n
        return reserved, budget

    def _stage_running(self, plan: Plan, reserved: list[tuple[Schedulable, int]], budget: int) -> int:
        """Schedule the running requests that reserved their blocks, lending each the staging area its
        offloaded layers need. Staging is lent once every running request has its blocks: it never
        costs one its place. One with no room waits and goes first next step."""
        unstaged = []
        for request, n in reserved:
            if n and self._stages(request, n):
                self._chunk(request, n, plan)
            else:
                unstaged.append(request)
                budget += n
        self._staging_waits = bool(unstaged)
        waits = {id(r) for r in unstaged}
        self.running = unstaged + [r for r in self.running if id(r) not in waits]
        if unstaged and not plan.chunks:  # nothing runs that would free the blocks their staging waits for
            self._preempt(self._pick_victim(unstaged), plan)
        return budget

    def _victims(self, pending: list[Schedulable], short: Schedulable) -> list[Schedulable]:
        """Who may give way to `short`: with every layer on the device it is short of device blocks
        only, which a request waiting for all of its layers to come back holds none of."""
        if not self.restores_decodes or short.offloaded:
            return pending
        layers = self.blocks.num_layers
        return [r for r in pending if not (len(r.offloaded) == layers and self._awaits_layers(r))]

    def _awaits_layers(self, request: Schedulable) -> bool:
        """Whether the request is prefilled and decodes only once its offloaded layers are back."""
        return self.restores_decodes and bool(request.offloaded) and \
            request.num_computed == request.num_tokens - 1 and decodes_next(request.view())

    def _unblock_restores(self, plan: Plan) -> None:
        """Nothing runs, so nothing will free the room the requests waiting for their layers wait for.
        The first in line (earliest scheduled) gets its layers back if the device holds them now (the
        policy's room kept the decodes' growth and the staging, which nothing uses this step), and
        decodes. Else the preemption policy's victim among those behind it that hold device blocks
        gives them up, so the first fits sooner; with none holding any, among all behind it.
        The first waiting alone fits but in one case: the device holds it at its longest (the engine
        refuses longer requests: max_model_len), idle cached prefixes count as free and are evicted
        for it, and the ledger's reservation is not kept from it when nobody else holds a place
        (_can_restore; its own promise was granted within the device). The case: prefix-cache nodes
        it committed before a forecast shrink took its layers (LayerKV's takes those of prefilling
        requests) stay held on the device beside the copy restored. Then its decode is staged this
        step, as in "stage": preempted, it would come back to the same wait, a prefill for each token."""
        waiting = sorted((r for r in self.running if self._awaits_layers(r)), key=lambda r: r.scheduled_at)
        if not waiting:
            return
        first, back = waiting[0], list(waiting[0].offloaded)
        if self._can_restore(first, back) and self.blocks.move_layers(first, back, "device"):
            self.layers_offloaded["restored"] += len(back)
            if self._reserve(first, 1):
                self._chunk(first, 1, plan)
            return
        behind = waiting[1:]
        if not behind and self._reserve(first, 1) and self._stages(first, 1):
            self._chunk(first, 1, plan)
            return
        holders = [r for r in behind if len(r.offloaded) < self.blocks.num_layers]
        self._preempt(self._pick_victim(holders or behind or waiting), plan)

    def _resume_swapped(self, plan: Plan, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            n = min(request.num_tokens - request.num_computed, budget)
            target = blocks_for(request.num_computed + n, self.blocks.block_size)
            room = self.ledger.headroom() - (self.ledger.params.reserved_blocks if self.allots_ahead else 0)
            if room < max(target, request.blocks_per_layer):
                break
            self.blocks.swap_in(request)
            if not self._reserve(request, n):  # cannot happen: room was checked above
                raise AssertionError("swap-in left no room for the step it was resumed for")
            if self.allots_ahead:  # allotted what it holds; past that it grows on demand or by the plan
                request.allocation = request.blocks_per_layer * self.blocks.block_size
            self.swapped.popleft()
            self._run(request, n, plan)
            budget -= n
        return budget

    def _admission_order(self, now: float) -> list[RequestView]:
        """The waiting requests' views, in the admission policy's order."""
        if not self.waiting:
            return []
        views = {r.request_id: r.view() for r in self.waiting}
        order = self.policies.prefill_admission(list(views.values()), ViewList(self.running),
                                                self.blocks.pool_view(), now)
        return [views[i] for i in order]

    def _admit_waiting(self, plan: Plan, budget: int, now: float, grants: list[Grant] | None,
                       retain: dict[str, int]) -> None:
        """Offer waiting requests a place: the allocation plan's, in its order, or (vLLM) every one in
        the admission policy's order, until the budget, the sequence limit or the KV says stop. A
        request LayerKV retains fewer layers of gets the others' blocks in the cxl tier."""
        by_id = {r.request_id: r for r in self.waiting}
        if grants is None:
            grants = [Grant(r.request_id, None) for r in self._admission_order(now)]
        for grant in grants:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            request = by_id[grant.request_id]
            if not self.chunked_prefill and request.num_tokens - request.num_computed > budget:
                return  # whole prompts only: it waits for a step with room for all of it
            if not self.ledger.allot(request, grant):
                return
            if request.awaits_kv:
                if not self._start_pull(request, plan, now):
                    self.ledger.settle(request)
                    return
                continue
            hit = self.blocks.find_prefix(request)
            n = min(request.num_tokens - hit.tokens, budget)
            if hit.nodes and not self._fits_with_prefix(request, hit, n):
                self.ledger.settle(request)
                return  # it waits its turn, its prefix untouched: nothing reloaded, counted or reranked
            cached = self.blocks.attach_prefix(request, now)
            if request.preemptions == 0:
                request.num_cached = cached
            if request.request_id in retain and not cached and request.push is None:
                self._place(request, retain[request.request_id])
            if not self._reserve(request, n) or not self._stages(request, n):
                self.blocks.release(request)  # give back what it was given; it waits its turn
                self.ledger.settle(request)
                request.num_computed = 0
                return
            self.waiting.remove(request)
            if self.staging_cap:  # only then are layers ever offloaded
                self.layers_offloaded["admitted"] += len(request.offloaded)
            if request.scheduled_at is None and self.reuse is not None:
                self.reuse.admitted(request)
            request.scheduled_at = now if request.scheduled_at is None else request.scheduled_at
            self._run(request, n, plan)
            budget -= n

    def _start_pull(self, request: Schedulable, plan: Plan, now: float) -> bool:
        """Give a decode-role request (or a push-mode reservation) blocks for its prompt's KV, if
        the allocation policy will."""
        if len(self.running) + len(self.pulling) >= self.max_num_seqs or \
                not self._reserve(request, request.num_tokens - 1):
            return False
        self.waiting.remove(request)
        request.scheduled_at = now if request.scheduled_at is None else request.scheduled_at
        request.status = Status.PULLING
        self.pulling.append(request)
        plan.pulls.append(request)
        return True

    def _place(self, request: LayeredRequest, keep: int) -> None:
        """Keep `keep` of the request's layers on the device, interleaved across depth; all of them if
        its layers could outgrow a half of the staging area (at its longest: its prompt and max_tokens).
        One that finds no staging room this step waits."""
        layers = self.blocks.num_layers
        if keep >= layers or not self.blocks.place(request, interleaved(layers, max(0, keep))):
            return
        view = request.view()
        longest = view.prompt_len + view.max_tokens
        if blocks_for(longest, self.blocks.block_size) > self.staging_cap:
            self.blocks.place(request, range(layers))

    def _run(self, request: Schedulable, n: int, plan: Plan) -> None:
        request.status = Status.RUNNING
        self.running.append(request)
        self._chunk(request, n, plan)

    def _chunk(self, request: Schedulable, n: int, plan: Plan) -> None:
        if self.staging_cap and request.offloaded:
            need = request.blocks_per_layer
            lent = self.blocks.lend(2 * need)
            plan.staging[0].extend(lent[:need])
            plan.staging[1].extend(lent[need:])
            self._staged += need
        plan.chunks.append(ScheduledChunk(request, n))

    def _fits_with_prefix(self, request: Schedulable, hit: PrefixHit, n: int) -> bool:
        """Whether the request, its cached prefix attached, would get blocks for `n` tokens more, asked
        before attaching it (as vLLM looks a prefix up, then allocates, and leaves a request it cannot
        place waiting with nothing copied): the prefix's nodes the device must hold or reload, the new
        blocks, and the copy a fully cached prompt writes its last token into."""
        needed = hit.tokens + n
        if not self._allotted(request, needed):
            return False
        block_size = self.blocks.block_size
        new = max(0, blocks_for(needed, block_size) - hit.nodes) + (hit.tokens < hit.nodes * block_size)
        return hit.taken + new * self.blocks.num_layers <= self.blocks.free("device")

    def _reserve(self, request: Schedulable, n: int) -> bool:
        """Blocks for this step's `n` tokens, within the request's allocation (grown if it must)."""
        needed = request.num_computed + n
        return self._allotted(request, needed) and \
            self.blocks.reserve(request, blocks_for(needed, self.blocks.block_size), n)

    def _allotted(self, request: Schedulable, needed: int) -> bool:
        """Whether the request's allocation covers `needed` tokens, grown by the ledger if it must."""
        return request.allocation is None or request.allocation >= needed or self.ledger.grow(request, needed)

    def _pick_victim(self, candidates: list[Schedulable], short: Schedulable | None = None) -> Schedulable:
        """The preemption policy's first victim; a host short of KV takes back its embedded guest first."""
        guest = next((r for r in candidates if short is not None and r.request_id in short.guests), None)
        if guest is not None:
            return guest
        by_id = {r.request_id: r for r in candidates}
        order = self.policies.preemption_order([r.view() for r in candidates], self.blocks.pool_view())
        return by_id[order[0]]

    def _preempt(self, victim: Schedulable, plan: Plan) -> None:
        strategy = self.policies.preemption_strategy(victim.view(), self.blocks.pool_view())
        victim.preemptions += 1
        self.ledger.settle(victim)
        if victim in self.running:
            self.running.remove(victim)
        if strategy == "swap" and self.blocks.swap_out(victim):
            victim.status = Status.SWAPPED
            self.swapped.append(victim)
        else:
            strategy = "recompute"
            self.blocks.release(victim)
            victim.num_computed = 0
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
        plan.preempted.append((victim, strategy))

