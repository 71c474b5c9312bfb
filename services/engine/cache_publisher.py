"""Keeps kvmeta's cache table in step with this engine's prefix cache (CaR III-B.1's table, shared:
what the scheduler's prefix-aware routing reads). Every `interval_s` it publishes the nodes cached,
moved between tiers or rescored since the last time and evicts those dropped (what it could not
send goes back in the journal); when kvmeta has forgotten the engine (its registration expired,
Redis lost its data) it publishes every node again.

The cache is read through a `CacheJournal` on the engine's own thread (`on_engine`): the native
engine's BlockManager or the vLLM backend's cxl-tier table."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvmesh.libs.controlplane import KvmeshError, cancel_and_wait
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import MAX_ITEMS, CacheEntry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheJournal:
    """An engine's prefix cache as the publisher reads it, on the engine's thread only: the native
    engine's BlockManager (native/cache_journal.py) or the vLLM backend's cxl-tier table."""

    take: Callable[[], tuple[Iterable[Any], list[str]]]   # nodes cached, moved or rescored, and dropped, since last
    nodes: Callable[[], Iterable[Any]]                    # every node cached now
    note: Callable[[list[str]], None]                     # journal these again as they are now (sending failed)
    entry: Callable[[Any], CacheEntry]                    # kvmeta's row of a node

    def changes(self) -> tuple[list[CacheEntry], list[str]]:
        """The first call starts the journal."""
        nodes, dropped = self.take()
        return [self.entry(n) for n in nodes], dropped

    def everything(self) -> list[CacheEntry]:
        return [self.entry(n) for n in self.nodes()]


class CachePublisher:
    def __init__(self, kvmeta: KvmetaClient, engine_id: str, journal: CacheJournal,
                 on_engine: Callable[[Callable[[], Any]], Awaitable[Any]], interval_s: float = 0.2):
        self.kvmeta, self.engine_id, self.journal, self.interval_s = kvmeta, engine_id, journal, interval_s
        self._on_engine = on_engine
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> CachePublisher:
        await self._on_engine(self.journal.changes)   # starts the journal
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def republish(self) -> None:
        """Everything cached, for a kvmeta that has forgotten this engine (WorkerPresence.on_register)."""
        await self._send(await self._on_engine(self.journal.everything), [])

    async def flush(self) -> None:
        entries, dropped = await self._on_engine(self.journal.changes)
        try:
            await self._send(entries, dropped)
        except KvmeshError:
            # Journalled again as they are now, for the next flush.
            ids = [e.node_id for e in entries] + dropped
            await self._on_engine(lambda: self.journal.note(ids))
            raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except KvmeshError as exc:
                log.warning("publishing the cache table failed: %s", exc)

    async def _send(self, entries: list[CacheEntry], dropped: list[str]) -> None:
        for start in range(0, len(entries), MAX_ITEMS):
            await self.kvmeta.publish(self.engine_id, entries[start:start + MAX_ITEMS])
        for start in range(0, len(dropped), MAX_ITEMS):
            await self.kvmeta.evict(self.engine_id, dropped[start:start + MAX_ITEMS])
