"""The prefix cache an engine runs, by name, as `sim run --cache` and `plan --caches` take it:
- `none`: no prefix cache (every prompt computed whole);
- `lru`: the prefix cache on the device tier, idle nodes evicted least recently used first;
- `car`: CaR (seeds/002): evicted nodes move to the cxl tier and come back on a hit or a prefetch, CaR's
  score orders eviction, and CaR's admission (priority classes and the Shuffled Window) orders prefills.
  It needs a cxl tier (`--cxl-blocks`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .cluster import Cluster
from .engine import EngineSpec
from .prefix_count import PrefixCount
from .request import SimRequest

CACHES = {"none": {}, "lru": {"cache_policy": "lru"}, "car": {"cache_policy": "car", "prefill_admission": "car"}}


def with_cache(spec: EngineSpec, cache: str) -> tuple[EngineSpec, dict[str, str]]:
    """The engine spec running `cache`, and the engine policies it sets."""
    if cache not in CACHES:
        raise ValueError(f"cache {cache!r}: one of {', '.join(CACHES)}")
    if cache == "car" and not spec.cxl_blocks:
        raise ValueError("cache car keeps evicted nodes in a cxl tier: give --cxl-blocks")
    return replace(spec, prefix_caching=cache != "none", cache_cxl=cache == "car"), dict(CACHES[cache])


def cache_figures(requests: Sequence[SimRequest], cluster: Cluster) -> dict | None:
    """With a prefix cache: the share of the prompts' tokens it gave, the prompt blocks looked up, the
    shares of those found on the device and in the cxl tier (its hit rates: a node the prefetcher
    brought back before its turn is found on the device), and the nodes moved to the cxl tier and
    prefetched back (CaR); None without one."""
    engines = [m.engine for m in cluster.members.values() if isinstance(m.engine.blocks, PrefixCount)]
    if not engines:
        return None
    counts = [engine.blocks for engine in engines]
    lookups = sum(c.lookup_blocks for c in counts)
    device, cxl = (sum(c.hit_blocks[tier] for c in counts) for tier in ("device", "cxl"))
    return {"prompt_tokens_cached": sum(r.num_cached for r in requests) / sum(r.prompt_len for r in requests),
            "lookup_blocks": lookups, "hit_rate_device": device / lookups if lookups else 0.0,
            "hit_rate_cxl": cxl / lookups if lookups else 0.0,
            "nodes_to_cxl": sum(c.moved_nodes["cxl"] for c in counts),
            "nodes_prefetched": sum(e.scheduler.reuse.prefetched for e in engines if e.scheduler.reuse is not None)}
