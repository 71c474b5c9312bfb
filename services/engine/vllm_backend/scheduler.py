"""KVMeshScheduler: vLLM's scheduler with kvmesh's pure policies where vLLM's structure lets them in.

Load it with `SchedulerConfig.scheduler_cls` ("kvmesh.services.engine.vllm_backend.scheduler.KVMeshScheduler")
and name the policies in `additional_config={"kvmesh": {"preemption_order": ..., "prefill_admission": ...}}`
(policies/registry.py's names). Before each step it hands the policies the same RequestView and
PoolView the native engine does, built from vLLM's requests and block pool:

- preemption order (CacheOpt 3.4 and its baselines): vLLM preempts the last of its running list
  when blocks run out, so the list is put in the policy's order, its first victim last. The order
  also decides who gets the step's token budget first, as the paper's order intends.
- prefill admission (LayerKV Algorithm 1): waiting requests the policy does not admit this step are
  held out of vLLM's queue for the step and put back in their places after it. LayerKV needs Eq. 3's
  prefill cost, which the engine service profiles on this vLLM engine at start (`prefill_cost`).

A request's SLOs and predicted output length ride in `SamplingParams.extra_args["kvmesh_targets"]`
(the engine service puts them there); first-token times are recorded as vLLM's outputs come back.
Not here yet: CacheOpt's allocation (3.3). vLLM allocates block by block, but allocate_slots takes
`reserved_blocks`, which a ledger of allotments could drive (docs/vllm.md says how). Not possible:
swap vs recompute, as vLLM v1 only recomputes. The native engine has both.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, deque
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from kvmesh.policies import registry
from kvmesh.policies.scheduling import PrefillCost
from kvmesh.policies.views import PoolView, RequestView, blocks_for

from ..request import Targets
from .policy_hooks import HOOKS, TARGETS

RECENT = 64  # preempted request ids kept for /v1/state
SCHEDULED_KEPT = 4096
TARGET_FIELDS = tuple(f.name for f in dataclasses.fields(Targets))


class KVMeshScheduler(Scheduler):
    def __init__(self, vllm_config, *args: Any, **kwargs: Any):
        super().__init__(vllm_config, *args, **kwargs)
        self.policy_names: dict[str, str] = {}
        self.set_policies({**{hook: registry.DEFAULTS[hook] for hook in HOOKS},
                           **(vllm_config.additional_config or {}).get("kvmesh", {})})
        self.prefill_cost: PrefillCost | None = None   # set by the engine service once profiled
        self.first_token_at: dict[str, float] = {}
        self.held_back = 0   # all time: waiting requests kept out of a step by the admission policy
        self.preemptions = 0  # all time
        self.recent_preemptions: deque[str] = deque(maxlen=RECENT)   # the latest victims, first first
        # when each request was first scheduled (unix seconds), for its trace: read once it finishes,
        # the oldest forgotten past SCHEDULED_KEPT (requests aborted before they finished)
        self.scheduled_at: OrderedDict[str, float] = OrderedDict()

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

    def schedule(self, *args: Any, **kwargs: Any):
        now = time.time()
        pool = self._pool_view()
        if len(self.running) > 1:
            victims_first = self.preemption_order([self._view(r) for r in self.running], pool)
            rank = {request_id: i for i, request_id in enumerate(victims_first)}
            self.running.sort(key=lambda r: -rank[r.request_id])   # vLLM preempts from the end
        held = self._hold_back(pool, now)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            if held:
                self._put_back(held)
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
        for request in self.running:
            if request.num_output_tokens and request.request_id not in self.first_token_at:
                self.first_token_at[request.request_id] = now
        return outputs

    def _free_request(self, request, *args: Any, **kwargs: Any):
        self.first_token_at.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)

    def _hold_back(self, pool: PoolView, now: float) -> list:
        """Take out of the waiting queue what the admission policy does not admit now; those taken."""
        waiting = [r for r in self.waiting if r.num_computed_tokens == 0 and not r.num_preemptions]
        if not waiting:
            return []
        admitted = set(self.prefill_admission([self._view(r) for r in waiting], [self._view(r) for r in self.running],
                                              pool, now))
        held = [r for r in waiting if r.request_id not in admitted]
        if held:
            self.waiting.remove_requests(held)
            self.held_back += len(held)
        return held

    def _put_back(self, held: list) -> None:
        """Held requests back behind whatever the step left waiting, in their arrival order."""
        for request in sorted(held, key=lambda r: r.arrival_time):
            self.waiting.add_request(request)

    def _pool_view(self) -> PoolView:
        pool = self.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1   # less vLLM's null block
        return PoolView(block_size=self.block_size, num_layers=1, free={"device": pool.get_num_free_blocks()},
                        total={"device": total}, prefill_cost=self.prefill_cost)

    def _view(self, request) -> RequestView:
        targets = ((request.sampling_params.extra_args or {}).get(TARGETS) or {}) if request.sampling_params else {}
        return RequestView(
            request_id=request.request_id, arrival=request.arrival_time, prompt_len=request.num_prompt_tokens,
            num_tokens=request.num_tokens, num_computed=request.num_computed_tokens,
            num_generated=request.num_output_tokens, max_tokens=request.max_tokens,
            blocks_per_layer=blocks_for(request.num_computed_tokens, self.block_size), tier="device",
            preemptions=request.num_preemptions, first_token_at=self.first_token_at.get(request.request_id),
            **{name: targets.get(name) for name in TARGET_FIELDS})
