"""Prefill admission: in which order waiting requests are offered a place in the batch.

Signature: (waiting, running, pool, now) -> request ids, first to admit first. The engine admits in
this order until the token budget, the sequence limit or the KV pool says stop; a policy that leaves
a waiting request out keeps it waiting this step (LayerKV admits only as many prefills as the
decoding requests' TPOT SLOs allow).
"""

from __future__ import annotations

from collections.abc import Sequence

from .views import PoolView, RequestView


def fcfs(waiting: Sequence[RequestView], running: Sequence[RequestView], pool: PoolView, now: float) -> list[str]:
    """First come, first served (vLLM, Orca)."""
    return [r.request_id for r in sorted(waiting, key=lambda r: r.arrival)]
