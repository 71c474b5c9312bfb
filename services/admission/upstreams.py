"""The policy services admission calls, the scheduler and the length predictor, swapped while it
serves: `GET`/`PUT /v1/upstreams` (docs/deploy.md, "Swapping a policy service").

A service is taken only if it answers `GET /ready` and its `GET /openapi.json` lists every operation
admission calls on it; otherwise the change is refused and nothing changes. A request's calls after
the swap go to the new service; a call already on its way finishes on the old client, which is
closed once the longest call it could still be making is over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from msgspec import UNSET, Meta, Struct, UnsetType, structs
from prometheus_client import CollectorRegistry, Counter

from kvmesh.libs.controlplane import BadRequest, KvmeshError, ServiceClient

from .predictor_client import PredictorClient
from .scheduler_client import SchedulerClient

log = logging.getLogger(__name__)

# What admission calls on each (predictor_client.py, scheduler_client.py): a replacement must serve all.
OPERATIONS = {"scheduler": {("post", "/v1/route"), ("get", "/v1/cluster")},
              "predictor": {("post", "/v1/predict"), ("post", "/v1/observe")}}


class UpstreamSettings(Struct, kw_only=True, frozen=True):
    """The services admission calls now; no `predictor_url`: requests run without a length prediction."""

    scheduler_url: str
    predictor_url: str | None


# A service's base URL: http(s), a host, and optionally a path prefix (a mesh's route, say).
ServiceUrl = Annotated[str, Meta(pattern=r"^https?://[^/\s?#]+(/[^\s?#]*)?$", max_length=2048)]


class UpstreamChange(Struct, kw_only=True, forbid_unknown_fields=True):
    """`PUT /v1/upstreams`: the URLs to change; those left out stay. `predictor_url: null` stops predicting."""

    scheduler_url: ServiceUrl | UnsetType = UNSET
    predictor_url: ServiceUrl | None | UnsetType = UNSET


class Upstreams:
    def __init__(self, scheduler_url: str, predictor_url: str | None, token: str | None, route_timeout_s: float,
                 predict_timeout_s: float, metrics: CollectorRegistry):
        self._token, self._route_timeout_s, self._predict_timeout_s = token, route_timeout_s, predict_timeout_s
        self.scheduler = SchedulerClient(scheduler_url, token, route_timeout_s)
        self.predictor = self._predictor(predictor_url)
        self._urls = UpstreamSettings(scheduler_url=scheduler_url, predictor_url=predictor_url)
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task] = set()
        self._swaps = Counter("kvmesh_admission_upstream_swaps", "Policy services swapped while serving",
                              ["upstream"], registry=metrics)

    def settings(self) -> UpstreamSettings:
        return self._urls

    async def swap(self, change: UpstreamChange) -> UpstreamSettings:
        """Check each new service, then switch to all of them at once; a refused one changes nothing."""
        async with self._lock:
            asked = {name: getattr(change, f"{name}_url") for name in OPERATIONS}
            wanted = {name: url and url.rstrip("/") for name, url in asked.items() if url is not UNSET}
            wanted = {name: url for name, url in wanted.items() if url != getattr(self._urls, f"{name}_url")}
            for name, url in wanted.items():
                if url is not None:
                    await self._check(name, url)
            for name, url in wanted.items():
                log.info("%s: %s -> %s", name, getattr(self._urls, f"{name}_url"), url)
                old = getattr(self, name)
                setattr(self, name, SchedulerClient(url, self._token, self._route_timeout_s) if name == "scheduler"
                        else self._predictor(url))
                if old is not None:
                    self._retire(old)
                self._swaps.labels(name).inc()
            self._urls = structs.replace(self._urls, **{f"{name}_url": url for name, url in wanted.items()})
            return self._urls

    async def close(self) -> None:
        for task in self._retiring:
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self.scheduler.close()
        if self.predictor is not None:
            await self.predictor.close()

    def _predictor(self, url: str | None) -> PredictorClient | None:
        return PredictorClient(url, self._token, self._predict_timeout_s) if url else None

    async def _check(self, name: str, url: str) -> None:
        async with ServiceClient(url, token=self._token, timeout=self._route_timeout_s, retries=0) as probe:
            try:
                await probe.call("GET", "/ready")
                api = await probe.call("GET", "/openapi.json", into=dict)
            except KvmeshError as exc:
                raise BadRequest(f"{name}_url {url} is not a ready service: {exc}") from None
        served = {(method.lower(), path) for path, item in (api.get("paths") or {}).items()
                  if isinstance(item, dict) for method in item}
        missing = sorted(OPERATIONS[name] - served)
        if missing:
            raise BadRequest(f"{name}_url {url} does not serve what admission calls on a {name}: "
                             + ", ".join(f"{method.upper()} {path}" for method, path in missing)
                             + " (its /openapi.json lists them)")

    def _retire(self, client: SchedulerClient | PredictorClient) -> None:
        async def close_when_done() -> None:
            try:
                await asyncio.sleep(client.longest_call_s)
            finally:
                await client.close()
        task = asyncio.create_task(close_when_done())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
