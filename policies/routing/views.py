"""Read-only views the scheduler hands its routing policies, and the decision they return."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine last reported in its heartbeat (plus what the scheduler sent it since)."""

    free_device_blocks: int
    total_device_blocks: int
    waiting: int = 0
    running: int = 0

    @property
    def used_fraction(self) -> float:
        """Share of the device tier in use; an engine without device blocks counts as full."""
        if self.total_device_blocks <= 0:
            return 1.0
        return 1.0 - self.free_device_blocks / self.total_device_blocks


@dataclass(frozen=True, slots=True)
class EngineView:
    id: str
    role: str                 # prefill | decode | both
    model: str
    load: EngineLoad
    block_size: int
    cached_blocks: int = 0    # leading blocks of this prompt the engine holds (kvmeta's cache table)
    cached_device_blocks: int | None = None  # of those, in its device tier (CaR); None: all of them
    kv_layout: tuple = ()     # backend and block geometry: a prefill engine hands KV only to a decode engine of the same

    @property
    def cached_cxl_blocks(self) -> int:
        """Of the cached blocks, those in the cxl tier: a reload away."""
        return 0 if self.cached_device_blocks is None else self.cached_blocks - self.cached_device_blocks


@dataclass(frozen=True, slots=True)
class RouteQuery:
    model: str
    prompt_tokens: int = 0
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """A (prefill, decode) pair, or one colocated engine; `cached_blocks` is what the engine that
    prefills holds of the prompt."""

    prefill: str | None = None
    decode: str | None = None
    engine: str | None = None
    cached_blocks: int = 0

    @property
    def mode(self) -> str:
        return "colocated" if self.engine is not None else "disaggregated"


@dataclass(frozen=True, slots=True)
class RoutingState:
    """What a policy carries from one call to the next; the caller keeps it (round robin's cursors:
    "model/role" -> id of the engine picked last)."""

    cursors: Mapping[str, str] = field(default_factory=dict)


RoutingPolicy = Callable[[RouteQuery, Sequence[EngineView], RoutingState], tuple[RouteDecision | None, RoutingState]]
