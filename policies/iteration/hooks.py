"""The engine-level policy decisions in force, by name; switchable at run time (`PUT /v1/policy`)."""

from __future__ import annotations

from collections.abc import Callable

from .. import registry


class Policies:
    """Each hook's function, as attributes, and their names in `names`."""

    prefill_admission: Callable
    kv_allocation: Callable
    preemption_order: Callable
    preemption_strategy: Callable
    cache_policy: Callable
    layer_offload: Callable

    def __init__(self, names: dict[str, str] | None = None):
        self.names: dict[str, str] = {}
        self.set({**registry.DEFAULTS, **(names or {})})

    def set(self, names: dict[str, str]) -> None:
        """Switch the named hooks; all or nothing (KeyError for an unknown hook or name)."""
        resolved = {hook: registry.resolve(hook, name) for hook, name in names.items()}
        self.names.update(names)
        for hook, function in resolved.items():
            setattr(self, hook, function)
