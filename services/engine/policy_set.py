"""The engine-level policy decisions in force, by name; switchable at run time (`PUT /v1/policy`)."""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.policies import registry


class Policies:
    """The engine-level decisions by name; switchable at run time."""

    def __init__(self, names: dict[str, str] | None = None):
        self.names = dict(registry.DEFAULTS)
        self.set(names or {})

    def set(self, names: dict[str, str]) -> None:
        resolved = {hook: registry.resolve(hook, name) for hook, name in names.items()}  # all or nothing
        self.names.update(names)
        for hook, name in self.names.items():
            setattr(self, hook, resolved.get(hook) or registry.resolve(hook, name))

    prefill_admission: Callable
    kv_allocation: Callable
    preemption_order: Callable
    preemption_strategy: Callable
    cache_policy: Callable
