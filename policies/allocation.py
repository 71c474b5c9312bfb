"""KV allocation: how many blocks per layer a request should hold after this step.

Signature: (request, new_tokens, pool) -> blocks per layer. The engine allocates the difference
from what the request holds, or preempts when the pool cannot give it.
"""

from __future__ import annotations

from .views import PoolView, RequestView


def block_at_a_time(request: RequestView, new_tokens: int, pool: PoolView) -> int:
    """Just enough for the tokens computed so far plus this step's (vLLM)."""
    return pool.blocks_for(request.num_computed + new_tokens)
