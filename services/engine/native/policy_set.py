"""The engine-level policy decisions in force: the iteration scheduler's (policies/iteration/hooks.py),
which the simulator's engine uses too."""

from kvmesh.policies.iteration.hooks import Policies

__all__ = ["Policies"]
