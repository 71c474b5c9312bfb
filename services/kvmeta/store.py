"""kvmeta's Redis store: each operation is one atomic Lua script from libs/kvmeta/lua."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from redis.asyncio import Redis

from kvmesh.libs.controlplane import NotFound
from kvmesh.libs.kvmeta.messages import (BlockLease, BlockRecord, CacheEntry, Heartbeat, HeartbeatAck, Load, PrefixMatch, ScoreDelta,
                                         Worker, WorkerInfo, WorkerRegistration)
from kvmesh.libs.kvmeta.schema import SCRIPTS, key_prefix, script_source

_json = msgspec.json.Encoder()


class _StoredEntry(msgspec.Struct):
    tier: str
    size: int
    score: float


class KvmetaStore:
    def __init__(self, redis: Redis, cluster: str):
        self.redis = redis
        self.prefix = key_prefix(cluster)
        self.events_channel = self.prefix + "events"
        self._scripts = {name: redis.register_script(script_source(name)) for name in SCRIPTS}

    async def _run(self, script: str, *args: object) -> object:
        return await self._scripts[script](keys=[self.prefix], args=list(args))

    # -- worker registry --------------------------------------------------------------------------

    async def register(self, registration: WorkerRegistration) -> Worker:
        info, ttl = registration.worker, registration.ttl_ms
        now = await self._run("register", info.id, _json.encode(info), _json.encode(Load()), ttl)
        return Worker(info=info, load=Load(), ttl_ms=ttl, registered_ms=now, heartbeat_ms=now, deadline_ms=now + ttl)

    async def heartbeat(self, worker_id: str, heartbeat: Heartbeat) -> HeartbeatAck:
        load = b"" if heartbeat.load is None else _json.encode(heartbeat.load)
        reply = await self._run("heartbeat", worker_id, load, heartbeat.ttl_ms or "")
        if not reply:
            raise NotFound(f"worker {worker_id} is not registered (expired or never joined): register again")
        now, ttl = reply
        return HeartbeatAck(heartbeat_ms=now, deadline_ms=now + ttl)

    async def deregister(self, worker_id: str) -> bool:
        return bool(await self._run("deregister", worker_id))

    async def reap(self, limit: int = 1000) -> int:
        return await self._run("reap", limit)

    async def workers(self, worker_id: str | None = None) -> tuple[int, list[Worker]]:
        reply = await self._run("workers", *([worker_id] if worker_id else []))
        now, fields = int(reply[0]), reply[1:]
        workers = [Worker(info=msgspec.json.decode(fields[i], type=WorkerInfo),
                          load=msgspec.json.decode(fields[i + 1], type=Load),
                          ttl_ms=int(fields[i + 2]), registered_ms=int(fields[i + 3]),
                          heartbeat_ms=int(fields[i + 4]), deadline_ms=int(float(fields[i + 5])))
                   for i in range(0, len(fields), 6)]
        return now, workers

    # -- cache table ------------------------------------------------------------------------------

    async def publish(self, engine: str, entries: Sequence[CacheEntry]) -> int:
        args: list[object] = [engine]
        for entry in entries:
            args += [entry.node_id, _json.encode(_StoredEntry(entry.tier, entry.size, entry.score))]
        added = await self._run("publish", *args)
        if added < 0:
            raise NotFound(f"engine {engine} is not a live worker: register it before publishing its cache")
        return added

    async def evict(self, engine: str, node_ids: Sequence[str]) -> int:
        return await self._run("evict", engine, *node_ids)

    async def scores(self, engine: str, deltas: Sequence[ScoreDelta]) -> int:
        return await self._run("scores", engine, *(x for d in deltas for x in (d.node_id, repr(d.delta))))

    async def lookup(self, node_ids: Sequence[str]) -> list[PrefixMatch]:
        reply = await self._run("lookup", *node_ids) if node_ids else []
        matches = [PrefixMatch(engine=reply[i].decode(), blocks=reply[i + 1], device_blocks=reply[i + 2])
                   for i in range(0, len(reply), 3)]
        return sorted(matches, key=lambda m: (-m.blocks, -m.device_blocks, m.engine))

    async def entries(self, node_id: str) -> dict[str, CacheEntry]:
        """Who holds one block, as stored (for inspection and tests)."""
        raw = await self.redis.hgetall(self.prefix + "node:" + node_id)
        return {engine.decode(): _entry(node_id, value) for engine, value in raw.items()}

    # -- block map --------------------------------------------------------------------------------

    async def put_blocks(self, request_id: str, lease: BlockLease) -> BlockRecord:
        deadline = await self._run("put_blocks", request_id, lease.engine, _json.encode(lease.layers),
                                   lease.token_count, lease.tier, lease.lease_ms)
        if deadline < 0:
            raise NotFound(f"engine {lease.engine} is not a live worker: register it before leasing its blocks")
        return BlockRecord(request_id=request_id, engine=lease.engine, layers=lease.layers,
                           token_count=lease.token_count, tier=lease.tier, deadline_ms=deadline)

    async def delete_blocks(self, request_id: str) -> bool:
        return bool(await self._run("delete_blocks", request_id))

    async def blocks(self, mode: str, subject: str = "", limit: int = 1000) -> tuple[int, list[BlockRecord]]:
        reply = await self._run("blocks", mode, subject, limit)
        now, fields = int(reply[0]), reply[1:]
        records = [BlockRecord(request_id=fields[i].decode(), engine=fields[i + 1].decode(),
                               layers=msgspec.json.decode(fields[i + 2], type=list[list[int]]),
                               token_count=int(fields[i + 3]), tier=fields[i + 4].decode(),
                               deadline_ms=int(float(fields[i + 5])))
                   for i in range(0, len(fields), 6)]
        return now, records


def _entry(node_id: str, raw: bytes) -> CacheEntry:
    stored = msgspec.json.decode(raw, type=_StoredEntry)
    return CacheEntry(node_id=node_id, tier=stored.tier, size=stored.size, score=stored.score)
