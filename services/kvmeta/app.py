"""kvmeta: the only process that talks to Redis. REST over the worker registry, the cache table
and the block map (see libs/kvmeta/messages.py for the bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web
from aiohttp_sse import sse_response
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvmesh.libs.controlplane import NotFound, Service, ServiceConfig, ServiceUnavailable, cancel_and_wait
from kvmesh.libs.kvmeta.messages import (BlockLease, BlockPath, BlockQuery, BlockRecord, BlockRecords, CacheEvict,
                                         CachePublish, CacheScores, Count, Heartbeat, HeartbeatAck, PrefixLookup, PrefixMatches,
                                         Removed, Worker, WorkerEvent, WorkerList, WorkerPath, WorkerRegistration)

from .connection import connect
from .store import KvmetaStore
from .watch import WorkerEventHub

log = logging.getLogger(__name__)


class Config(ServiceConfig, kw_only=True):
    port: int = 8103
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Failover (docs/deploy.md): with Sentinels ("host:port"), the master of group `redis_master`;
    # redis_url then gives only the password and database.
    redis_sentinels: list[str] = []
    redis_master: str = "kvmesh"
    redis_timeout_s: float = 1.0
    reap_interval_s: float = 0.25
    watch_queue: int = 1024
    watch_ping_s: float = 5.0


class KvmetaRoutes:
    """kvmeta's routes, one method each, over the store and the hub that fans worker events out to
    watchers; and the service's upkeep: the event subscription, the reaper, readiness."""

    def __init__(self, config: Config, redis: Redis, store: KvmetaStore, hub: WorkerEventHub):
        self.config = config
        self.redis = redis
        self.store = store
        self.hub = hub

    async def background(self, app: web.Application) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(self.hub.run()),
                 asyncio.create_task(_reap_forever(self.store, self.config.reap_interval_s))]
        yield
        await cancel_and_wait(tasks)
        await self.redis.aclose()

    async def end_watch_streams(self) -> None:
        self.hub.end_all()

    async def redis_answers(self) -> None:
        await self.redis.ping()
        if not self.hub.subscribed.is_set():
            raise ServiceUnavailable("kvmeta is not yet subscribed to worker events")

    # -- worker registry --------------------------------------------------------------------------

    async def register(self, request: web.Request, body: WorkerRegistration) -> Worker:
        """Register a worker (a restart: what kvmeta held for this id before is dropped)."""
        return await self.store.register(body)

    async def list_workers(self, request: web.Request) -> WorkerList:
        """Live workers with their last reported load."""
        now, workers = await self.store.workers()
        return WorkerList(workers=workers, now_ms=now)

    async def watch(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: a snapshot of the live workers, then every join and leave."""
        hub, ping_s = self.hub, self.config.watch_ping_s
        if not hub.subscribed.is_set():
            raise ServiceUnavailable("worker events are not available: kvmeta is not subscribed to Redis")
        queue = hub.watch()  # before the snapshot, so no event falls between the two
        try:
            now, workers = await self.store.workers()
            async with sse_response(request, ping_interval=ping_s) as stream:
                with contextlib.suppress(ConnectionResetError):  # the watcher went away: nothing to answer
                    await stream.send(_text(WorkerEvent(kind="snapshot", at_ms=now, workers=workers)))
                    while stream.is_connected():
                        with contextlib.suppress(asyncio.TimeoutError):
                            event = await asyncio.wait_for(queue.get(), timeout=ping_s)
                            if event is None:
                                break
                            await stream.send(_text(event))
                stream.stop_streaming()
            return stream
        finally:
            hub.unwatch(queue)

    async def get_worker(self, request: web.Request, params: WorkerPath) -> Worker:
        """One live worker."""
        _, workers = await self.store.workers(params.worker_id)
        if not workers:
            raise NotFound(f"worker {params.worker_id} is not registered")
        return workers[0]

    async def heartbeat(self, request: web.Request, params: WorkerPath, body: Heartbeat) -> HeartbeatAck:
        """Extend a worker's TTL and record its load; 404 means it expired and must register again."""
        return await self.store.heartbeat(params.worker_id, body)

    async def deregister(self, request: web.Request, params: WorkerPath) -> Removed:
        """Remove a worker with its cache entries and block leases; watchers see it leave."""
        return Removed(removed=await self.store.deregister(params.worker_id))

    # -- cache table ------------------------------------------------------------------------------

    async def publish(self, request: web.Request, body: CachePublish) -> Count:
        """Record prefix blocks an engine holds (NodeID, tier, size, score); count is the new ones."""
        return Count(count=await self.store.publish(body.engine, body.entries))

    async def lookup(self, request: web.Request, body: PrefixLookup) -> PrefixMatches:
        """For a prompt's NodeIDs, each live holder and how many leading blocks it has, longest first."""
        return PrefixMatches(matches=await self.store.lookup(body.node_ids))

    async def evict(self, request: web.Request, body: CacheEvict) -> Count:
        """Forget blocks an engine no longer holds; count is how many were known."""
        return Count(count=await self.store.evict(body.engine, body.node_ids))

    async def scores(self, request: web.Request, body: CacheScores) -> Count:
        """Add to the scores of an engine's entries (CaR replacement); count is how many exist."""
        return Count(count=await self.store.scores(body.engine, body.deltas))

    # -- block map --------------------------------------------------------------------------------

    async def list_blocks(self, request: web.Request, query: BlockQuery) -> BlockRecords:
        """Leases past their deadline (their blocks are to be reclaimed), or all, of one engine or all."""
        now, records = await self.store.blocks("expired" if query.expired else "all", query.engine or "", query.limit)
        return BlockRecords(records=records, now_ms=now)

    async def put_blocks(self, request: web.Request, params: BlockPath, body: BlockLease) -> BlockRecord:
        """Record (or renew) the blocks an engine holds for a request, with a lease."""
        return await self.store.put_blocks(params.request_id, body)

    async def get_blocks(self, request: web.Request, params: BlockPath) -> BlockRecord:
        """The blocks held for one request."""
        _, records = await self.store.blocks("one", params.request_id, 1)
        if not records:
            raise NotFound(f"no blocks are recorded for request {params.request_id}")
        return records[0]

    async def delete_blocks(self, request: web.Request, params: BlockPath) -> Removed:
        """Drop a request's record once its blocks are freed."""
        return Removed(removed=await self.store.delete_blocks(params.request_id))


def build_service(config: Config) -> Service:
    service = Service("kvmeta", config)
    redis, where = connect(config.redis_url, config.redis_sentinels, config.redis_master, config.redis_timeout_s)
    store = KvmetaStore(redis, config.cluster)
    kvmeta = KvmetaRoutes(config, redis, store, WorkerEventHub(redis, store.events_channel, config.watch_queue))
    service.translate(RedisConnectionError, lambda e: ServiceUnavailable(f"Redis at {where} is unreachable: {e}"))
    service.translate(RedisTimeoutError, lambda e: ServiceUnavailable(f"Redis at {where} did not answer in time: {e}"))
    # A master demoted by a failover refuses writes until the pool reconnects to the new one.
    service.translate(ReadOnlyError, lambda e: ServiceUnavailable(f"Redis at {where} is failing over: {e}"))
    service.lifespan(kvmeta.background)
    service.on_shutdown(kvmeta.end_watch_streams)
    service.readiness(kvmeta.redis_answers)

    service.route("POST", "/v1/workers", body=WorkerRegistration, response=Worker)(kvmeta.register)
    service.route("GET", "/v1/workers", response=WorkerList)(kvmeta.list_workers)
    service.route("GET", "/v1/workers/watch")(kvmeta.watch)
    service.route("GET", "/v1/workers/{worker_id}", params=WorkerPath, response=Worker)(kvmeta.get_worker)
    service.route("PUT", "/v1/workers/{worker_id}/heartbeat", params=WorkerPath, body=Heartbeat,
                  response=HeartbeatAck)(kvmeta.heartbeat)
    service.route("DELETE", "/v1/workers/{worker_id}", params=WorkerPath, response=Removed)(kvmeta.deregister)
    service.route("POST", "/v1/cache/publish", body=CachePublish, response=Count)(kvmeta.publish)
    service.route("POST", "/v1/cache/lookup", body=PrefixLookup, response=PrefixMatches)(kvmeta.lookup)
    service.route("POST", "/v1/cache/evict", body=CacheEvict, response=Count)(kvmeta.evict)
    service.route("POST", "/v1/cache/scores", body=CacheScores, response=Count)(kvmeta.scores)
    service.route("GET", "/v1/blocks", query=BlockQuery, response=BlockRecords)(kvmeta.list_blocks)
    service.route("PUT", "/v1/blocks/{request_id}", params=BlockPath, body=BlockLease,
                  response=BlockRecord)(kvmeta.put_blocks)
    service.route("GET", "/v1/blocks/{request_id}", params=BlockPath, response=BlockRecord)(kvmeta.get_blocks)
    service.route("DELETE", "/v1/blocks/{request_id}", params=BlockPath, response=Removed)(kvmeta.delete_blocks)
    return service


async def _reap_forever(store: KvmetaStore, interval: float) -> None:
    """Announce expired workers. Every kvmeta replica may run this; the script announces each once."""
    failing = False
    while True:
        try:
            await store.reap()
            failing = False
        except (RedisError, OSError) as exc:
            if not failing:
                log.warning("reaper cannot reach Redis: %s", exc)
            failing = True
        await asyncio.sleep(interval)


def _text(event: WorkerEvent) -> str:
    return msgspec.json.encode(event).decode()
