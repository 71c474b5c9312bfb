"""The iteration scheduler: each step, which requests compute how many tokens (continuous
batching at iteration level, as in Orca and vLLM), with chunked prefill under a token budget.

The decisions are the policies' (policies/): who is admitted, how many blocks a request gets, who
is preempted and how, what the prefix cache drops. This file carries them out, in the order of
ARCHITECTURE.md: running requests first (decodes and unfinished prefill chunks), then swapped-out
ones coming back, then waiting ones in admission order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from kvmesh.policies.allocation import block_at_a_time
from kvmesh.policies.views import RequestView, blocks_for

from .block_manager import BlockManager
from .policy_set import Policies
from .request import Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int     # tokens whose KV this step computes

    @cached_property  # read by the runner and the engine, before the step moves num_computed on
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so a new one is sampled."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass
class Plan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[tuple[Request, str]] = field(default_factory=list)
    pulls: list[Request] = field(default_factory=list)  # decode role: given blocks, their KV to pull now


class Scheduler:
    def __init__(self, blocks: BlockManager, policies: Policies, max_num_seqs: int, token_budget: int):
        self.blocks = blocks
        self.policies = policies
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.pulling: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Whether a step would do anything (a pull in flight is not the step's work)."""
        return bool(self.waiting or self.running or self.swapped)

    def find(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting, self.swapped, self.pulling):
            for request in queue:
                if request.request_id == request_id:
                    return request
        return None

    def finish(self, request: Request, reason: str, release: bool = True) -> None:
        """Take a request out of the engine and, unless told not to, give its blocks back."""
        for queue in (self.running, self.waiting, self.swapped, self.pulling):
            if request in queue:
                queue.remove(request)
        if release:
            self.blocks.release(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def pulled(self, request: Request, now: float) -> None:
        """The prompt's KV has arrived: the request decodes from its last prompt token on."""
        self.pulling.remove(request)
        request.num_computed, request.kv_source, request.reservation = request.num_tokens - 1, None, False
        self.blocks.commit(request, now)
        request.status = Status.RUNNING
        self.running.append(request)

    # -- one iteration ----------------------------------------------------------------------------

    def schedule(self, now: float) -> Plan:
        plan = Plan()
        budget = self._schedule_running(plan, self.token_budget)
        if not plan.preempted:
            budget = self._resume_swapped(plan, budget)
            self._admit_waiting(plan, budget, now)
        return plan

    def _schedule_running(self, plan: Plan, budget: int) -> int:
        pending, kept = list(self.running), []
        while pending and budget > 0:
            request = pending.pop(0)
            n = min(request.num_tokens - request.num_computed, budget)
            while not self._reserve(request, n):
                victim = self._pick_victim(pending + [request])
                self._preempt(victim, plan)
                if victim is request:
                    break
                pending.remove(victim)
            if request.status is Status.RUNNING:
                plan.chunks.append(ScheduledChunk(request, n))
                kept.append(request)
                budget -= n
        self.running = kept + pending
        return budget

    def _resume_swapped(self, plan: Plan, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            n = min(request.num_tokens - request.num_computed, budget)
            target = self._target_blocks(request, n)
            if self.blocks.free("device") < max(target, request.blocks_per_layer) * self.blocks.num_layers:
                break
            self.blocks.swap_in(request)
            if not self._reserve(request, n):  # cannot happen: room was checked above
                raise AssertionError("swap-in left no room for the step it was resumed for")
            self.swapped.popleft()
            self._run(request, n, plan)
            budget -= n
        return budget

    def _admit_waiting(self, plan: Plan, budget: int, now: float) -> None:
        if not self.waiting:
            return
        by_id = {r.request_id: r for r in self.waiting}
        order = self.policies.prefill_admission([view(r) for r in self.waiting], self.blocks.pool_view(), now)
        for request_id in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            request = by_id[request_id]
            if request.kv_source is not None or request.reservation:
                if not self._start_pull(request, plan, now):
                    return
                continue
            cached = self.blocks.attach_prefix(request, now)
            if request.preemptions == 0:
                request.num_cached = cached
            n = min(request.num_tokens - request.num_computed, budget)
            if not self._reserve(request, n):
                self.blocks.release(request)  # give back the prefix it was lent; it waits its turn
                request.num_computed = 0
                return
            self.waiting.remove(request)
            request.scheduled_at = request.scheduled_at or now
            self._run(request, n, plan)
            budget -= n

    def _start_pull(self, request: Request, plan: Plan, now: float) -> bool:
        """Give a decode-role request (or a push-mode reservation) blocks for its prompt's KV, if
        the allocation policy will."""
        if len(self.running) + len(self.pulling) >= self.max_num_seqs or not self._reserve(request, request.num_tokens - 1):
            return False
        self.waiting.remove(request)
        request.scheduled_at = request.scheduled_at or now
        request.status = Status.PULLING
        self.pulling.append(request)
        plan.pulls.append(request)
        return True

    def _run(self, request: Request, n: int, plan: Plan) -> None:
        request.status = Status.RUNNING
        self.running.append(request)
        plan.chunks.append(ScheduledChunk(request, n))

    def _target_blocks(self, request: Request, n: int) -> int:
        if self.policies.kv_allocation is block_at_a_time:
            # The default policy's own formula, without building the views it would read them from
            # (~2.5 us a request, every step: a measurable share of a small decode step).
            return blocks_for(request.num_computed + n, self.blocks.block_size)
        return self.policies.kv_allocation(view(request), n, self.blocks.pool_view())

    def _reserve(self, request: Request, n: int) -> bool:
        return self.blocks.reserve(request, self._target_blocks(request, n), n)

    def _pick_victim(self, candidates: list[Request]) -> Request:
        by_id = {r.request_id: r for r in candidates}
        order = self.policies.preemption_order([view(r) for r in candidates], self.blocks.pool_view())
        return by_id[order[0]]

    def _preempt(self, victim: Request, plan: Plan) -> None:
        strategy = self.policies.preemption_strategy(view(victim), self.blocks.pool_view())
        victim.preemptions += 1
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


def view(request: Request) -> RequestView:
    return RequestView(request_id=request.request_id, arrival=request.arrival, prompt_len=len(request.prompt_ids),
                       num_tokens=request.num_tokens, num_computed=request.num_computed,
                       num_generated=len(request.output_ids), max_tokens=request.sampling.max_tokens,
                       blocks_per_layer=request.blocks_per_layer, tier=request.tier,
                       preemptions=request.preemptions, tbt_slo_ms=request.targets.tbt_slo_ms,
                       predicted_output_len=request.targets.predicted_output_len)
