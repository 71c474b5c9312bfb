"""Prefix aware (CaR's cache-aware routing): send the prompt where its longest prefix is cached,
unless that engine's load costs more than the cache saves. Decode engines are picked by load alone
(they compute no prompt).

Score of a prefill (or colocated) engine e, in prompt tokens, highest wins:

    score(e) = w_cache  * (device(e) + w_cxl * cxl(e))            prefill tokens e need not compute,
                        * block_size(e)                             those in its cxl tier a reload away
             - w_queue  * waiting(e)        * prompt_tokens       requests queued ahead, each taken as
                                                                  about as long as this prompt
             - w_memory * used_fraction(e)  * prompt_tokens       device memory in use: a full engine
                                                                  preempts or evicts to make room

Defaults: w_cache = 1, w_cxl = 0.95 (CaR Fig. 5, `kvmesh bench car`: reloading a 2,048-token prefix
from the cxl tier costs 13 ms where recomputing it costs 302 ms and finding it on the device 8 ms),
w_queue = 0.5 (with chunked prefill a queued request delays this one by about half its own
prefill), w_memory = 1. So caching the whole prompt is worth two requests waiting
ahead, or an engine entirely full against an empty one. Ties go to the least loaded engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from .least_loaded import load_key, pick_least_loaded
from .roles import choose
from .views import EngineView, RouteDecision, RouteQuery, RoutingState

W_CACHE, W_CXL, W_QUEUE, W_MEMORY = 1.0, 0.95, 0.5, 1.0


def score(engine: EngineView, prompt_tokens: int, w_cache: float = W_CACHE, w_queue: float = W_QUEUE,
          w_memory: float = W_MEMORY, w_cxl: float = W_CXL) -> float:
    load = engine.load
    cached = engine.cached_blocks - (1 - w_cxl) * engine.cached_cxl_blocks
    return (w_cache * cached * engine.block_size
            - w_queue * load.waiting * prompt_tokens
            - w_memory * load.used_fraction * prompt_tokens)


def prefix_aware(query: RouteQuery, engines: Sequence[EngineView], state: RoutingState, *,
                 w_cache: float = W_CACHE, w_queue: float = W_QUEUE,
                 w_memory: float = W_MEMORY) -> tuple[RouteDecision | None, RoutingState]:
    def pick_prefill(candidates: Sequence[EngineView], role: str) -> EngineView:
        return min(candidates, key=lambda e: (-score(e, query.prompt_tokens, w_cache, w_queue, w_memory), load_key(e)))

    return choose(query, engines, pick_prefill, pick_least_loaded), state
