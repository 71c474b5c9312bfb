"""Policies by name, for config and for `PUT /v1/policy`; other packages add theirs through the
`kvmesh.policies` entry-point group (entry name `HOOK:NAME`, value a function)."""

from __future__ import annotations

from collections.abc import Callable

from . import allocation, cache, offload, plugins, preemption, prefill_admission, swap_recompute

HOOKS: dict[str, dict[str, Callable]] = {
    "prefill_admission": {"fcfs": prefill_admission.fcfs, "layerkv": prefill_admission.layerkv,
                          "car": prefill_admission.car, "like_lengths": prefill_admission.like_lengths},
    "kv_allocation": {"block_at_a_time": allocation.block_at_a_time, "estimate": allocation.estimate,
                      "rlp": allocation.estimate, "s3": allocation.s3, "cacheopt": allocation.cacheopt,
                      "cacheopt_guarded": allocation.cacheopt_guarded},
    "preemption_order": {"latest_arrival_first": preemption.latest_arrival_first,
                         "fcfs": preemption.latest_arrival_first, "srtf": preemption.srtf,
                         "lkvo": preemption.lkvo, "cacheopt": preemption.cacheopt},
    "preemption_strategy": {"recompute": preemption.recompute, "swap": preemption.swap,
                            "sweet_spot": swap_recompute.sweet_spot_strategy},
    "cache_policy": {"lru": cache.lru, "car": cache.car},
    "layer_offload": {"none": offload.none, "layerkv": offload.layerkv},
}

DEFAULTS = {"prefill_admission": "fcfs", "kv_allocation": "block_at_a_time",
            "preemption_order": "latest_arrival_first", "preemption_strategy": "recompute", "cache_policy": "lru",
            "layer_offload": "none"}


def resolve(hook: str, name: str) -> Callable:
    if hook not in HOOKS:
        raise KeyError(f"unknown policy hook {hook!r}; hooks: {', '.join(HOOKS)}")
    return plugins.resolve(hook, HOOKS[hook], name, f"{hook} policy")
