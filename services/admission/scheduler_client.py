"""Admission's side of the scheduler API (docs/serving.md): `POST /v1/route` and `GET /v1/cluster`."""

from __future__ import annotations

from kvmesh.libs.controlplane import ServiceClient
from kvmesh.libs.messages.scheduler import ClusterView, Route, RouteRequest


class SchedulerClient:
    def __init__(self, url: str, token: str | None, timeout_s: float):
        self._client = ServiceClient(url, token=token, timeout=timeout_s)

    @property
    def longest_call_s(self) -> float:
        return self._client.longest_call_s

    async def route(self, model: str, prompt_token_ids: list[int], exclude: list[str]) -> Route:
        """Where to run the request; 503 `no_engine` when nothing (not excluded) serves the model."""
        body = RouteRequest(model=model, prompt_token_ids=prompt_token_ids, exclude=exclude)
        return await self._client.call("POST", "/v1/route", body, into=Route)

    async def cluster(self) -> ClusterView:
        return await self._client.call("GET", "/v1/cluster", into=ClusterView)

    async def close(self) -> None:
        await self._client.close()
