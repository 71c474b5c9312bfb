"""The prefix cache's policies: which idle nodes to evict (replacement) and when to bring nodes back
from the cxl tier ahead of the request that needs them (prefetch, CaR III-B.2)."""

from .prefetch import fetch, time_to_free_s
from .replacement import DONE_SCORE, RUN_SCORE, WINDOW_SCORE, car, lru

__all__ = ["DONE_SCORE", "RUN_SCORE", "WINDOW_SCORE", "car", "fetch", "lru", "time_to_free_s"]
