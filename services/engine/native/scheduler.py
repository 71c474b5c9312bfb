"""The native engine's iteration scheduler: the one the simulator runs too (policies/iteration/),
over the engine's BlockManager and Request."""

from __future__ import annotations

from kvmesh.policies.iteration import Scheduler as IterationScheduler

from .request import Request


class Scheduler(IterationScheduler):
    def pulled(self, request: Request, now: float) -> None:
        """The prompt's KV has arrived (pulled, or pushed into its reservation): it decodes from its last
        prompt token on."""
        request.kv_source, request.reservation = None, False
        super().pulled(request, now)
