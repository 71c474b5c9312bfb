"""Admission's side of the scheduler API (docs/serving.md): `POST /v1/route` and `GET /v1/cluster`."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from kvmesh.libs.controlplane import ServiceClient

from .engine_client import EngineRef


class Route(Struct, kw_only=True, frozen=True):
    """A (prefill, decode) pair, or one colocated `engine`."""

    mode: Literal["disaggregated", "colocated"]
    prefill: EngineRef | None = None
    decode: EngineRef | None = None
    engine: EngineRef | None = None
    policy: str = ""
    cached_blocks: int = 0


class ClusterEngine(Struct, kw_only=True, frozen=True):
    id: str
    role: str
    model: str
    control_url: str
    data_address: str = ""

    def ref(self) -> EngineRef:
        return EngineRef(id=self.id, control_url=self.control_url, data_address=self.data_address, role=self.role)


class ClusterView(Struct, kw_only=True, frozen=True):
    engines: list[ClusterEngine]


class SchedulerClient:
    def __init__(self, url: str, token: str | None, timeout_s: float):
        self._client = ServiceClient(url, token=token, timeout=timeout_s)

    @property
    def longest_call_s(self) -> float:
        return self._client.longest_call_s

    async def route(self, model: str, prompt_token_ids: list[int], exclude: list[str]) -> Route:
        """Where to run the request; 503 `no_engine` when nothing (not excluded) serves the model."""
        body = {"model": model, "prompt_token_ids": prompt_token_ids, "exclude": exclude}
        return await self._client.call("POST", "/v1/route", body, into=Route)

    async def cluster(self) -> ClusterView:
        return await self._client.call("GET", "/v1/cluster", into=ClusterView)

    async def close(self) -> None:
        await self._client.close()
