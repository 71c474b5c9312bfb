"""A vLLM request's account in the allocation ledger (policies/allocation/ledger.py's Allottee)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Allotment:
    request: Any                             # vllm.v1.request.Request
    held_blocks: Callable[[str], int]        # blocks vLLM has given a request, by its id
    allocation: int | None = None
    passes: list[tuple[str, int]] = field(default_factory=list)
    guests: list[str] = field(default_factory=list)
    tier: str = "device"                     # vLLM keeps a running request's KV on the device only

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def blocks_per_layer(self) -> int:
        return self.held_blocks(self.request.request_id)
