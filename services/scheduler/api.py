"""Bodies of the scheduler's HTTP API (docs/serving.md), and its errors of its own."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from kvmesh.libs.controlplane import NotFound, ServiceUnavailable
from kvmesh.libs.kvmeta.messages import Id

MAX_PROMPT_TOKENS = 262_144  # the prompt is hashed into NodeIDs on the event loop: bound the work
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]


class NoEngine(ServiceUnavailable):
    """No live engine serves the model now (or every one that does was excluded)."""

    type = "no_engine"


class UnknownModel(NotFound):
    """No engine has served the model since the scheduler started: the caller asked for the wrong one."""

    type = "model_not_found"


class RouteRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/route`: the prompt to place, and engines to avoid (admission's retry after a failure)."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)] = field(default_factory=list)
    exclude: Annotated[list[Id], Meta(max_length=1024)] = field(default_factory=list)


class WorkerRef(Struct, kw_only=True, frozen=True):
    id: str
    control_url: str
    data_address: str
    role: str


class Route(Struct, kw_only=True, frozen=True):
    """A (prefill, decode) pair, or one colocated `engine`; `cached_blocks` is how many leading blocks
    of the prompt the engine that prefills holds."""

    mode: Literal["disaggregated", "colocated"]
    prefill: WorkerRef | None
    decode: WorkerRef | None
    engine: WorkerRef | None
    policy: str
    cached_blocks: int


class EngineStatus(Struct, kw_only=True, frozen=True):
    """A live engine as the scheduler sees it: its last reported load, and routes sent since."""

    id: str
    role: str
    model: str
    control_url: str
    data_address: str
    free_blocks: dict[str, int]
    total_device_blocks: int
    waiting: int
    running: int
    routed_since_heartbeat: int


class ClusterView(Struct, kw_only=True, frozen=True):
    """`GET /v1/cluster`: the live engines, by id, and the routing policy in force."""

    policy: str
    engines: list[EngineStatus]


class PolicyChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    """`PUT /v1/policy`: the routing policy to use from now on."""

    policy: Annotated[str, Meta(min_length=1, max_length=128)]


class PolicyInfo(Struct, kw_only=True, frozen=True):
    policy: str
    available: list[str]
