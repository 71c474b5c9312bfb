"""First come, first served: the prefill admission of vLLM and Orca, the baseline."""

from __future__ import annotations

from collections.abc import Sequence

from ..views import PoolView, RequestView


def fcfs(waiting: Sequence[RequestView], running: Sequence[RequestView], pool: PoolView, now: float) -> list[str]:
    """First come, first served (vLLM, Orca)."""
    return [r.request_id for r in sorted(waiting, key=lambda r: r.arrival)]
