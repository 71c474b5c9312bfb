"""What the engine thread hands the service after a step or a command (engine_loop.py): frames for
the clients' streams, pulls to start, and held KV given up. The engine calls nothing of the
service's: the service reads these and acts on its own loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.libs.messages.engine import Frame, KVHandle


@dataclass(frozen=True)
class PullOrder:
    """The scheduler gave a request blocks for its KV, `local[layer]`: pull it from `source`, or, for
    a reservation (`source` None), tell the caller of kv/reserve where to push it."""

    request_id: str
    source: KVHandle | None
    local: list[list[int]]


@dataclass
class EngineEvents:
    frames: list[Frame] = field(default_factory=list)
    pulls: list[PullOrder] = field(default_factory=list)
    released: list[str] = field(default_factory=list)   # request ids whose held KV was freed (to unlease)

    def __bool__(self) -> bool:
        return bool(self.frames or self.pulls or self.released)

    def __iadd__(self, other: EngineEvents | None) -> EngineEvents:
        if other is not None:
            self.frames += other.frames
            self.pulls += other.pulls
            self.released += other.released
        return self
