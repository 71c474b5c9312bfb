"""Keeps kvmeta's cache table in step with this engine's prefix cache (CaR III-B.1's table, shared:
what the scheduler's prefix-aware routing reads). Every `interval_s` it publishes the nodes cached,
moved between tiers or rescored since the last time and evicts those dropped (what it could not
send goes back in the journal); when kvmeta has forgotten the engine (its registration expired,
Redis lost its data) it publishes every node again."""

from __future__ import annotations

import asyncio
import logging

from kvmesh.libs.controlplane import KvmeshError, cancel_and_wait
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import MAX_ITEMS, CacheEntry

from .engine import EngineLoop

log = logging.getLogger(__name__)


class CachePublisher:
    def __init__(self, kvmeta: KvmetaClient, engine_id: str, loop: EngineLoop, interval_s: float = 0.2):
        self.kvmeta, self.engine_id, self.loop, self.interval_s = kvmeta, engine_id, loop, interval_s
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> CachePublisher:
        await self._on_engine(lambda: self.loop.engine.blocks.take_cache_changes())  # starts the journal
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def republish(self) -> None:
        """Everything cached, for a kvmeta that has forgotten this engine (WorkerPresence.on_register)."""
        entries = await self._on_engine(lambda: self._entries(self.loop.engine.blocks.cached.values()))
        await self._send(entries, [])

    async def flush(self) -> None:
        def take() -> tuple[list[CacheEntry], list[str]]:
            nodes, dropped = self.loop.engine.blocks.take_cache_changes()
            return self._entries(nodes), dropped
        entries, dropped = await self._on_engine(take)
        try:
            await self._send(entries, dropped)
        except KvmeshError:
            # Journalled again as they are now, for the next flush.
            ids = [e.node_id for e in entries] + dropped
            await self._on_engine(lambda: self.loop.engine.blocks.note_cache_changes(ids))
            raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except KvmeshError as exc:
                log.warning("publishing the cache table failed: %s", exc)

    def _entries(self, nodes) -> list[CacheEntry]:
        """kvmeta's rows of `nodes`, read on the engine thread (their tier and score change there)."""
        blocks = self.loop.engine.blocks
        return [CacheEntry(node_id=n.node_id, tier=n.tier, size=blocks.node_bytes(n), score=float(n.score)) for n in nodes]

    async def _on_engine(self, read):
        """Run `read` on the engine thread, between steps."""
        return await asyncio.wrap_future(self.loop.call(lambda: (read(), [])))

    async def _send(self, entries: list[CacheEntry], dropped: list[str]) -> None:
        for start in range(0, len(entries), MAX_ITEMS):
            await self.kvmeta.publish(self.engine_id, entries[start:start + MAX_ITEMS])
        for start in range(0, len(dropped), MAX_ITEMS):
            await self.kvmeta.evict(self.engine_id, dropped[start:start + MAX_ITEMS])
