"""A SimEngine whose prefix-cache copies (CaR's cxl tier) are timed on cache_links.py's links, one each
way, instead of each alone under the step it is made in: a step waits for its room and for the
prefetches of the nodes its requests hold, and a prefetch or an idle offload holds its link for the
copies queued behind it. A step's `cache_offload_s` is then what it waits for before it computes,
its `cache_load_s` what its reloads run past that; its other times are SimEngine's.

SimEngine itself times each copy alone (`sim run`, `plan` and the benches); `sim paper car` runs this."""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.policies.allocation import AllocationParams

from .cache_links import CacheLinks
from .engine import EngineSpec, SimEngine, Step
from .request import SimRequest
from .step_cost import StepCost


class LinkedEngine(SimEngine):
    def __init__(self, spec: EngineSpec, cost: StepCost, policies: Mapping[str, str] | None = None,
                 allocation: AllocationParams = AllocationParams()):
        if not spec.cache_cxl:
            raise ValueError("the links carry the prefix cache's copies to and from its cxl tier: cache_cxl")
        super().__init__(spec, cost, policies, allocation)
        self.links = self.blocks.links = CacheLinks(spec.swap_out_bytes_per_s, spec.swap_in_bytes_per_s)

    def schedule(self, now: float) -> Step:
        self.links.at(now)
        step = super().schedule(now)
        held = [node for request, _ in step.chunks for node in request.cached_nodes] if self.links.landing else []
        step.cache_offload_s, step.cache_load_s = self.links.waits(held)
        return step

    def complete(self, step: Step, done: float) -> list[SimRequest]:
        self.links.at(done)   # the idle offload after the step is queued at its end
        return super().complete(step, done)
