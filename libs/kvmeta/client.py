"""The typed async client of the kvmeta service: what every other service uses instead of Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from kvmesh.libs.controlplane import KvmeshError, RemoteError, ServiceClient, cancel_and_wait

from .messages import (BlockLease, BlockRecord, BlockRecords, CacheEntry, CacheEvict, CachePublish, CacheScores, Count,
                       Heartbeat, HeartbeatAck, Load, PrefixLookup, PrefixMatch, PrefixMatches, Removed, ScoreDelta, Worker,
                       WorkerEvent, WorkerInfo, WorkerList, WorkerRegistration)

log = logging.getLogger(__name__)


class KvmetaClient:
    def __init__(self, url: str, token: str | None = None, **options: object):
        self.http = ServiceClient(url, token=token, **options)

    async def close(self) -> None:
        await self.http.close()

    async def __aenter__(self) -> KvmetaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- worker registry --------------------------------------------------------------------------

    async def register(self, info: WorkerInfo, ttl_ms: int = 5_000) -> Worker:
        # Registering twice is harmless (it restarts the worker's record), so it may be retried.
        return await self.http.call("POST", "/v1/workers", WorkerRegistration(worker=info, ttl_ms=ttl_ms),
                                    into=Worker, idempotent=True)

    async def heartbeat(self, worker_id: str, load: Load | None = None, ttl_ms: int | None = None) -> HeartbeatAck:
        """Extend the TTL; raises RemoteError 404 when the worker expired and must register again."""
        return await self.http.call("PUT", f"/v1/workers/{worker_id}/heartbeat", Heartbeat(load=load, ttl_ms=ttl_ms),
                                    into=HeartbeatAck)

    async def deregister(self, worker_id: str) -> bool:
        return (await self.http.call("DELETE", f"/v1/workers/{worker_id}", into=Removed)).removed

    async def workers(self) -> list[Worker]:
        return (await self.http.call("GET", "/v1/workers", into=WorkerList)).workers

    async def worker(self, worker_id: str) -> Worker:
        return await self.http.call("GET", f"/v1/workers/{worker_id}", into=Worker)

    async def watch(self, retry_delay: float = 0.2) -> AsyncIterator[WorkerEvent]:
        """Join and leave events, forever. Every (re)connection starts with a `snapshot` event of the
        live workers, so a watcher that was cut off resynchronises by itself."""
        delay = retry_delay
        while True:
            try:
                async for event in self.http.events("/v1/workers/watch", WorkerEvent):
                    delay = retry_delay
                    yield event
            except KvmeshError as exc:
                if isinstance(exc, RemoteError) and exc.status in (401, 403):
                    raise
                log.info("worker watch interrupted (%s); reconnecting", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    # -- cache table ------------------------------------------------------------------------------

    async def publish(self, engine: str, entries: Sequence[CacheEntry]) -> int:
        return (await self.http.call("POST", "/v1/cache/publish", CachePublish(engine=engine, entries=list(entries)),
                                     into=Count, idempotent=True)).count

    async def lookup(self, node_ids: Sequence[str]) -> list[PrefixMatch]:
        return (await self.http.call("POST", "/v1/cache/lookup", PrefixLookup(node_ids=list(node_ids)),
                                     into=PrefixMatches, idempotent=True)).matches

    async def evict(self, engine: str, node_ids: Sequence[str]) -> int:
        return (await self.http.call("POST", "/v1/cache/evict", CacheEvict(engine=engine, node_ids=list(node_ids)),
                                     into=Count, idempotent=True)).count

    async def add_scores(self, engine: str, deltas: Mapping[str, float]) -> int:
        body = CacheScores(engine=engine, deltas=[ScoreDelta(node_id=n, delta=d) for n, d in deltas.items()])
        return (await self.http.call("POST", "/v1/cache/scores", body, into=Count)).count

    # -- block map --------------------------------------------------------------------------------

    async def lease_blocks(self, request_id: str, lease: BlockLease) -> BlockRecord:
        return await self.http.call("PUT", f"/v1/blocks/{request_id}", lease, into=BlockRecord)

    async def blocks(self, request_id: str) -> BlockRecord:
        return await self.http.call("GET", f"/v1/blocks/{request_id}", into=BlockRecord)

    async def release_blocks(self, request_id: str) -> bool:
        return (await self.http.call("DELETE", f"/v1/blocks/{request_id}", into=Removed)).removed

    async def leases(self, engine: str | None = None, *, expired: bool = True, limit: int = 1000) -> list[BlockRecord]:
        """Leases past their deadline (default) or all of them, of one engine or of every engine."""
        params = {"engine": engine, "expired": expired, "limit": limit}
        return (await self.http.call("GET", "/v1/blocks", params=params, into=BlockRecords)).records


class WorkerPresence:
    """Keeps a worker registered: registers, heartbeats every ttl/3 with its current load, and
    registers again if kvmeta forgot it (TTL ran out, Redis lost its data). Deregisters on exit.

        async with WorkerPresence(kvmeta, info, load=engine.load):
            ...serve...
    """

    def __init__(self, client: KvmetaClient, info: WorkerInfo, *, ttl_ms: int = 5_000,
                 load: Callable[[], Load] = Load, on_register: Callable[[], object] | None = None):
        self.client, self.info, self.ttl_ms, self.load = client, info, ttl_ms, load
        self.on_register = on_register  # e.g. republish the cache table after kvmeta forgot us
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WorkerPresence:
        await self._register()
        self._task = asyncio.create_task(self._beat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        try:
            await self.client.deregister(self.info.id)
        except KvmeshError as error:
            log.warning("could not deregister %s: %s", self.info.id, error)

    async def _register(self) -> None:
        await self.client.register(self.info, self.ttl_ms)
        if self.on_register is not None:
            result = self.on_register()
            if asyncio.iscoroutine(result):
                await result

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                try:
                    await self.client.heartbeat(self.info.id, self.load())
                except RemoteError as exc:
                    if exc.status != 404:
                        raise
                    log.info("kvmeta forgot %s; registering again", self.info.id)
                    await self._register()
            except KvmeshError as exc:
                log.warning("heartbeat of %s failed: %s", self.info.id, exc)
