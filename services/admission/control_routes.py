"""Admission's internal side: `GET`/`PUT /v1/upstreams` swap the scheduler or the length predictor
for another service speaking the same API while requests flow (upstreams.py); ready when the
scheduler answers; the clients closed when admission stops."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from .engine_client import EngineClients
from .upstreams import UpstreamChange, Upstreams, UpstreamSettings


class ControlRoutes:
    """The internal routes, one method each, and admission's upkeep: its readiness and its clients."""

    def __init__(self, upstreams: Upstreams, engines: EngineClients):
        self.upstreams = upstreams
        self.engines = engines

    async def clients(self, app: web.Application) -> AsyncIterator[None]:
        yield
        await self.engines.close()
        await self.upstreams.close()

    async def scheduler_answers(self) -> None:
        await self.upstreams.scheduler.cluster()

    async def get_upstreams(self, request: web.Request) -> UpstreamSettings:
        """The scheduler and the length predictor admission calls now."""
        return self.upstreams.settings()

    async def set_upstreams(self, request: web.Request, body: UpstreamChange) -> UpstreamSettings:
        """Swap the scheduler or the length predictor for another service speaking the same API, while
        requests flow; one that is not ready or lacks an operation admission calls is refused."""
        return await self.upstreams.swap(body)
