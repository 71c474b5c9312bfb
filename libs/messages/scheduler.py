"""The scheduler API's bodies (docs/serving.md; docs/api/scheduler.openapi.json): a route asked for
and given, the cluster as the scheduler sees it, and its routing policy. The scheduler and admission
both import these."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from kvmesh.libs.kvmeta.messages import Id

MAX_PROMPT_TOKENS = 262_144  # the prompt is hashed into NodeIDs on the event loop: bound the work
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]


class RouteRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/route`: the prompt to place, and engines to avoid (admission's retry after a failure)."""

    model: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)] = field(default_factory=list)
    exclude: Annotated[list[Id], Meta(max_length=1024)] = field(default_factory=list)


class WorkerRef(Struct, kw_only=True, frozen=True):
    """An engine as the scheduler names it in a route."""

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

    def ref(self) -> WorkerRef:
        return WorkerRef(id=self.id, control_url=self.control_url, data_address=self.data_address, role=self.role)


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
