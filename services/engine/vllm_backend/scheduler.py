"""KVMeshScheduler: vLLM's scheduler with kvmesh's pure policies where vLLM's structure lets them in.

Load it with `SchedulerConfig.scheduler_cls` ("kvmesh.services.engine.vllm_backend.scheduler.KVMeshScheduler")
and name the policies in `additional_config={"kvmesh": {"policies": {"preemption_order": ..., ...}, "allocation":
{...AllocationParams}}}` (policies/registry.py's names). Before each step it hands the policies the same
RequestView and PoolView the native engine does, built from vLLM's requests and block pool:

- preemption order (CacheOpt 3.4 and its baselines): vLLM preempts the last of its running list
  when blocks run out, so the list is put in the policy's order, its first victim last. The order
  also decides who gets the step's token budget first, as the paper's order intends.
- prefill admission (LayerKV Algorithm 1): waiting requests the policy does not admit this step are
  held out of vLLM's queue for the step and put back in their places after it. LayerKV needs Eq. 3's
  prefill cost, which the engine service profiles on this vLLM engine at start (`prefill_cost`).
- KV allocation (CacheOpt 3.3 and its baselines RLP and S^3): the native engine's ledger
  (policies/allocation/ledger.py) over vLLM's block pool. Each step the policy's plan is applied: running
  requests' new allocations, the victims it names preempted with vLLM's own preemption, and of the
  waiting requests only those whose grant the ledger covers left in vLLM's queue, in the plan's
  order. vLLM still hands out blocks as tokens come, but its `allocate_slots` is wrapped so a
  request past its allocation gets blocks only if the ledger can grow it (from the unallocated KV,
  the global reservation, others' unused allotments); when it cannot, vLLM preempts as it does when
  blocks run out.

A request's SLOs and predicted output length ride in `SamplingParams.extra_args["kvmesh_targets"]`
(the engine service puts them there); token times are recorded as vLLM's outputs come back.
Not possible: swap vs recompute, as vLLM v1 only recomputes. The native engine has it.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvmesh.libs.messages.engine import Targets
from kvmesh.policies import registry
from kvmesh.policies.allocation import AllocationInput, AllocationParams, Grant, block_at_a_time
from kvmesh.policies.allocation.ledger import Ledger
from kvmesh.policies.costs import PrefillCost
from kvmesh.policies.views import PoolView, RequestView, blocks_for

from .allotment import Allotment
from .policy_hooks import HOOKS, TARGETS

RECENT = 64  # preempted request ids kept for /v1/state
SCHEDULED_KEPT = 4096
TARGET_FIELDS = Targets.__struct_fields__
ITERATIONS_KEPT = 256  # recent step times, for CacheOpt's T_I^max


class KVMeshScheduler(Scheduler):
    def __init__(self, vllm_config, *args: Any, **kwargs: Any):
        super().__init__(vllm_config, *args, **kwargs)
        settings = (vllm_config.additional_config or {}).get("kvmesh", {})
        self.policy_names: dict[str, str] = {}
        self.allotments: dict[str, Allotment] = {}   # requests with an allocation, by id
        self.set_policies({**{hook: registry.DEFAULTS[hook] for hook in HOOKS}, **settings.get("policies", {})})
        self.prefill_cost: PrefillCost | None = None   # set by the engine service once profiled
        self.first_token_at: dict[str, float] = {}
        # tokens out so far, when the last came, and the time per token since the step before (None: the first)
        self.last_token_at: dict[str, tuple[int, float, float | None]] = {}
        self.held_back = 0   # all time: waiting requests kept out of a step by the admission or allocation policy
        self.preemptions = 0  # all time
        self.planned_preemptions = 0   # of them, victims the allocation plan named before a step
        self.recent_preemptions: deque[str] = deque(maxlen=RECENT)   # the latest victims, first first
        # when each request was first scheduled (unix seconds), for its trace: read once it finishes,
        # the oldest forgotten past SCHEDULED_KEPT (requests aborted before they finished)
        self.scheduled_at: OrderedDict[str, float] = OrderedDict()
        self.iteration_s: deque[float] = deque(maxlen=ITERATIONS_KEPT)
        self._step_started = 0.0
        pool = self.kv_cache_manager.block_pool
        self.ledger = Ledger(AllocationParams(**settings.get("allocation", {})), self.block_size,
                             pool.get_num_free_blocks, self.allotments.values)
        self._allocate_slots = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate_within_allotment

    @property
    def allots_ahead(self) -> bool:
        """Whether the allocation policy in force allots KV ahead (every one but vLLM's own)."""
        return self.kv_allocation is not block_at_a_time

    def set_policies(self, names: dict[str, str]) -> None:
        """Switch policies by hook; KeyError, and nothing switched, for a hook or name it does not know."""
        unknown = set(names) - set(HOOKS)
        if unknown:
            raise KeyError(f"no policy hook {', '.join(sorted(unknown))} on the vLLM backend; it has "
                           f"{', '.join(HOOKS)}")
        resolved = {hook: registry.resolve(hook, name) for hook, name in names.items()}
        for hook, policy in resolved.items():
            setattr(self, hook, policy)
            self.policy_names[hook] = names[hook]
        if not self.allots_ahead:   # blocks as they go from now on: no allocation outlives its policy
            self.allotments.clear()

    def schedule(self, *args: Any, **kwargs: Any):
        now = self._step_started = time.time()
        pool = self._pool_view()
        if len(self.running) > 1:
            victims_first = self.preemption_order([self._view(r) for r in self.running], pool)
            rank = {request_id: i for i, request_id in enumerate(victims_first)}
            self.running.sort(key=lambda r: -rank[r.request_id])   # vLLM preempts from the end
        held = self._plan_allocation(pool, now) if self.allots_ahead else self._hold_back(pool, now)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            if held:
                self._put_back(held)
        if self.allotments:   # granted a place it did not get: the allotment goes back
            for request in list(self.waiting):
                self._settle(request)
        for new in output.scheduled_new_reqs:
            self.scheduled_at.setdefault(new.req_id, now)
        while len(self.scheduled_at) > SCHEDULED_KEPT:
            self.scheduled_at.popitem(last=False)
        victims = output.preempted_req_ids or ()
        self.preemptions += len(victims)
        self.recent_preemptions.extend(sorted(victims))
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        now = time.time()
        self.iteration_s.append(now - self._step_started)
        for request in self.running:
            out = request.num_output_tokens
            if out and request.request_id not in self.first_token_at:
                self.first_token_at[request.request_id] = now
            last = self.last_token_at.get(request.request_id)
            if out and (last is None or out > last[0]):
                gap = None if last is None else (now - last[1]) / (out - last[0])
                self.last_token_at[request.request_id] = (out, now, gap)
        return outputs

    def _free_request(self, request, *args: Any, **kwargs: Any):
        self.first_token_at.pop(request.request_id, None)
        self.last_token_at.pop(request.request_id, None)
        self._settle(request)
        return super()._free_request(request, *args, **kwargs)

    def _preempt_request(self, request, *args: Any, **kwargs: Any) -> None:
        self._settle(request)
        super()._preempt_request(request, *args, **kwargs)

    def _settle(self, request) -> None:
        allotment = self.allotments.pop(request.request_id, None)
        if allotment is not None:
            self.ledger.settle(allotment)

    # -- admission --------------------------------------------------------------------------------

    def _admissible(self) -> list:
        """Waiting requests the policies decide on: in vLLM's queue, holding no blocks, not blocked."""
        return [r for r in self.waiting if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]

    def _admission_order(self, waiting: list, pool: PoolView, now: float) -> list:
        """Those of `waiting` the prefill admission policy admits now, in its order."""
        by_id = {r.request_id: r for r in waiting}
        order = self.prefill_admission([self._view(r) for r in waiting], [self._view(r) for r in self.running],
                                       pool, now)
        return [by_id[i] for i in order]

    def _hold_back(self, pool: PoolView, now: float) -> list:
        """Take out of the waiting queue what the admission policy does not admit now; those taken."""
        waiting = [r for r in self._admissible() if r.num_computed_tokens == 0 and not r.num_preemptions]
        if not waiting:
            return []
        admitted = {r.request_id for r in self._admission_order(waiting, pool, now)}
        held = self._take([r for r in waiting if r.request_id not in admitted])
        self.held_back += len(held)
        return held

    def _plan_allocation(self, pool: PoolView, now: float) -> list:
        """Apply the allocation policy's plan for this step (see the module's docstring); the waiting
        requests taken out of the queue for the step: all but those granted a place."""
        waiting = self._admissible()
        ordered = self._admission_order(waiting, pool, now) if waiting else []
        running_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        plan = self.kv_allocation(AllocationInput(
            waiting=[self._view(r) for r in ordered], running=[self._view(r) for r in self.running],
            unallocated=self.ledger.grantable_tokens(), token_budget=self.max_num_scheduled_tokens - running_tokens,
            max_iteration_s=max(self.iteration_s, default=0.0), now=now, params=self.ledger.params))
        running = {r.request_id: r for r in self.running}
        for grant in plan.grants:
            if grant.request_id in running:
                self.ledger.allot(self._allotment(running[grant.request_id]), grant)
        victims = [running[i] for i in plan.preempt if self._request_blocks_can_be_freed(running[i])]
        goal = self.ledger.unallocated_tokens() + plan.preempt_tokens
        for victim in victims:
            self._preempt(victim)
        while plan.preempt_tokens and self.ledger.unallocated_tokens() < goal:
            candidates = [r for r in self.running if r.request_id not in plan.critical
                          and self._request_blocks_can_be_freed(r)]
            if not candidates:
                break
            victims.append(candidates[-1])   # the preemption order's first victim (the list is in its order)
            self._preempt(candidates[-1])
        granted = self._grant_waiting([g for g in plan.grants if g.request_id not in running], ordered)
        held = self._take([r for r in waiting if r.request_id not in granted])
        self.held_back += len(held)
        # The victims wait for a later step: the room they made is for the plan's waiting requests.
        held += self._take(victims)
        self._take(granted.values())
        self.waiting.prepend_requests(reversed(granted.values()))   # to the front, in the plan's order
        return held

    def _grant_waiting(self, grants: list[Grant], ordered: list) -> dict[str, Any]:
        """Apply the waiting requests' grants in order until one does not fit; those granted, in order."""
        by_id = {r.request_id: r for r in ordered}
        granted: dict[str, Any] = {}
        for grant in grants:
            allotment = self._allotment(by_id[grant.request_id])
            if not self.ledger.allot(allotment, grant):
                self._settle(allotment.request)
                break
            granted[grant.request_id] = allotment.request
        return granted

    def _preempt(self, victim) -> None:
        """Preempt a running request before the step, as vLLM does within it (its id reaches the step's output)."""
        self.running.remove(victim)
        self._preempt_request(victim, time.monotonic())
        self.planned_preemptions += 1

    def _take(self, requests) -> list:
        """Out of vLLM's waiting queue for this step."""
        requests = list(requests)
        if requests:
            self.waiting.remove_requests(requests)
        return requests

    def _put_back(self, held: list) -> None:
        """Held requests back in their arrival order: the preempted ones ahead of all, as vLLM puts
        them, the others behind whatever the step left waiting."""
        held = sorted(held, key=lambda r: r.arrival_time)
        self.waiting.prepend_requests(reversed([r for r in held if r.num_preemptions]))   # it reverses them
        for request in held:
            if not request.num_preemptions:
                self.waiting.add_request(request)

    # -- the allocation ledger over vLLM's blocks -------------------------------------------------

    def _allotment(self, request) -> Allotment:
        allotment = self.allotments.get(request.request_id)
        if allotment is None:
            allotment = self.allotments[request.request_id] = Allotment(request, self._held_blocks)
        return allotment

    def _held_blocks(self, request_id: str) -> int:
        return len(self.kv_cache_manager.coordinator.get_blocks(request_id)[0])

    def _allocate_within_allotment(self, request, num_new_tokens: int, **kwargs: Any):
        """vLLM's allocate_slots, for a request with an allocation only within it (grown if the ledger
        can); None, as vLLM's own when blocks run out, if not."""
        allotment = self.allotments.get(request.request_id)
        if allotment is not None and allotment.allocation is not None:
            needed = (request.num_computed_tokens + num_new_tokens + kwargs.get("num_new_computed_tokens", 0)
                      + kwargs.get("num_external_computed_tokens", 0) + kwargs.get("num_lookahead_tokens", 0))
            if needed > allotment.allocation and not self.ledger.grow(allotment, needed):
                return None
        return self._allocate_slots(request, num_new_tokens, **kwargs)

    def _pool_view(self) -> PoolView:
        pool = self.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1   # less vLLM's null block
        return PoolView(block_size=self.block_size, num_layers=1, free={"device": pool.get_num_free_blocks()},
                        total={"device": total}, prefill_cost=self.prefill_cost)

    def _view(self, request) -> RequestView:
        targets = ((request.sampling_params.extra_args or {}).get(TARGETS) or {}) if request.sampling_params else {}
        allotment = self.allotments.get(request.request_id)
        last = self.last_token_at.get(request.request_id)
        return RequestView(
            request_id=request.request_id, arrival=request.arrival_time, prompt_len=request.num_prompt_tokens,
            num_tokens=request.num_tokens, num_computed=request.num_computed_tokens,
            num_generated=request.num_output_tokens, max_tokens=request.max_tokens,
            blocks_per_layer=blocks_for(request.num_computed_tokens, self.block_size), tier="device",
            preemptions=request.num_preemptions, first_token_at=self.first_token_at.get(request.request_id),
            last_token_at=last[1] if last else None, last_token_gap_s=last[2] if last else None,
            allocation=allotment.allocation if allotment else None,
            **{name: targets.get(name) for name in TARGET_FIELDS})
