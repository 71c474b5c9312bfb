"""KV allocation: how much KV each request is allotted, decided once per step for the whole batch
(CacheOpt 3.3 and its baselines). `plan` has the contract."""

from .block import block_at_a_time
from .cacheopt import cacheopt, cacheopt_guarded
from .estimate import estimate, s3
from .plan import AllocationInput, AllocationParams, AllocationPlan, Grant

__all__ = ["AllocationInput", "AllocationParams", "AllocationPlan", "Grant", "block_at_a_time", "cacheopt",
           "cacheopt_guarded", "estimate", "s3"]
