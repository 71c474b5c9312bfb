"""RLP's sequence scheduling (CacheOpt section 5: RLP "tries to schedule the requests with similar
lengths in the same batch"), at iteration level: the oldest waiting request first, so none starves,
then the others by how near their estimated output length is to its, the older first at a tie. The
engine admits in this order until the budget stops it, so a step's new prompts are of like lengths."""

from __future__ import annotations

from collections.abc import Sequence

from ..views import PoolView, RequestView


def like_lengths(waiting: Sequence[RequestView], running: Sequence[RequestView], pool: PoolView,
                 now: float) -> list[str]:
    if not waiting:
        return []
    oldest = min(waiting, key=lambda r: r.arrival)
    rest = sorted((r for r in waiting if r is not oldest),
                  key=lambda r: (abs(r.estimated_output_len - oldest.estimated_output_len), r.arrival))
    return [oldest.request_id] + [r.request_id for r in rest]
