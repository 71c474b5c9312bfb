"""The native engine as the engine service's backend (backend.py): its loop thread, its half of the
KV hand-off (pull, push and reservations), the cache table, and its policies switched by name."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvmesh.libs.controlplane import BadRequest
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import BlockGeometry, Capacity, GpuNic
from kvmesh.libs.messages.engine import (CacheEntry, CacheQuery, CacheTable, Frame, GenerateRequest, KVHandle,
                                         SamplingParams)

from ..backend import EngineBackend, tokenizer_spec
from ..cache_publisher import CacheJournal
from ..config import EngineConfig
from ..metrics import NativeEngineCollector
from ..state import EngineState
from ..steps import EngineSteps
from .cache_journal import native_journal
from .engine_loop import EngineLoop
from .events import EngineEvents
from .factory import build_engine, max_model_len
from .handoff_service import KVHandoff


class NativeBackend(EngineBackend):
    name = "native"
    collector = NativeEngineCollector

    def __init__(self, config: EngineConfig):
        self.config = config
        self.loop: EngineLoop | None = None

    def start(self, on_frames: Callable[[list[Frame]], None]) -> None:
        def deliver(events: EngineEvents) -> None:  # on the engine's thread
            self.handoff.on_events(events)  # held KV is leased before its frame reaches the stream
            if events.frames:
                on_frames(events.frames)

        self.loop = EngineLoop(lambda: build_engine(self.config), deliver)
        self.engine = engine = self.loop.start()
        self.handoff = KVHandoff(self.config, engine, self.loop)
        self.tokenizer = engine.tokenizer
        spec = engine.runner.model.config
        self.vocab_size = spec.vocab_size
        self.context_limit = max_model_len(self.config, engine)
        self.tokenizer_spec = tokenizer_spec(self.config.model, engine.tokenizer, list(engine.eos_token_ids),
                                             self.context_limit)
        blocks = engine.blocks
        self.geometry = BlockGeometry(block_size=blocks.block_size, num_layers=spec.num_layers,
                                      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=self.config.dtype)
        self.capacity = Capacity(device_blocks=blocks.device.num_blocks,
                                 cxl_blocks=blocks.pools["cxl"].num_blocks if "cxl" in blocks.pools else 0)

    @property
    def data_address(self) -> str:
        return self.engine.data_address

    @property
    def pairing(self) -> list[GpuNic]:
        link = self.handoff.link
        return [GpuNic(gpu=link.gpu, nic=link.nic, address=self.data_address)] if link and self.data_address else []

    async def __aenter__(self) -> NativeBackend:
        await self.handoff.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await asyncio.to_thread(self.loop.stop)  # stepping stops before the data plane closes
        finally:
            await self.handoff.__aexit__(*exc)

    def state(self) -> EngineState:
        return self.loop.state

    def steps(self, since: int) -> EngineSteps:
        return self.loop.steps.read(since)

    def clock(self) -> float:
        return self.engine.clock()

    async def add(self, request_id: str, body: GenerateRequest, ids: list[int], sampling: SamplingParams,
                  arrival: float) -> None:
        engine, handoff, targets = self.engine, self.handoff, body.targets
        handoff.check(body, ids)
        push = await handoff.push_for(body)
        if body.kv_transfer is not None:
            handoff.traced(request_id)
        if handoff.claims(body):  # push mode: the KV is already in blocks reserved here
            if not await self._call(lambda: engine.claim(request_id, ids, sampling, arrival, targets)):
                handoff.untraced(request_id)
                raise BadRequest(f"kv_source: no reservation {request_id} for {len(ids) - 1} tokens on this engine "
                                 "(expired, or never made)")
            return
        def queue() -> None:
            engine.add(request_id, ids, sampling, hold_kv=body.kv_transfer is not None and push is None, push=push,
                       kv_source=body.kv_source, arrival=arrival, targets=targets)
        self.loop.submit(queue)

    def ended(self, request_id: str, last: Frame | None) -> None:
        if last is None or last.kv_handle is None:
            self.handoff.untraced(request_id)
        super().ended(request_id, last)

    def abort_soon(self, request_id: str) -> None:
        self.loop.submit(lambda: EngineEvents(frames=self.engine.abort(request_id)))

    async def abort(self, request_id: str) -> bool:
        def stop() -> tuple[bool, EngineEvents]:
            events = self.engine.release_held(request_id)
            events.frames = self.engine.abort(request_id)
            return bool(events), events
        return await asyncio.wrap_future(self.loop.call(stop))

    async def abort_all(self, request_ids: list[str]) -> None:
        def abort_all() -> tuple[None, EngineEvents]:
            return None, EngineEvents(frames=[frame for request_id in request_ids for frame in self.engine.abort(request_id)])
        await asyncio.wrap_future(self.loop.call(abort_all))

    async def set_policies(self, policies: dict[str, str]) -> dict[str, str]:
        scheduler = self.engine.scheduler

        def switch() -> dict[str, str]:
            if policies.get("layer_offload", "none") != "none" and not scheduler.staging_cap:
                raise KeyError("layer_offload needs a cxl tier to offload to: start the engine with cxl_blocks "
                               "or cxl_bytes")
            scheduler.policies.set(policies)
            return dict(scheduler.policies.names)
        return await self._call(switch)

    async def reserve(self, request_id: str, num_tokens: int) -> KVHandle:
        return await self.handoff.reserve(request_id, num_tokens)

    async def cache_table(self, query: CacheQuery) -> CacheTable:
        blocks = self.engine.blocks

        def read() -> CacheTable:
            entries = [CacheEntry(node_id=n.node_id, tier=n.tier, blocks=list(n.blocks), size_bytes=blocks.node_bytes(n),
                                  valid_in_gpu=n.tier == "device", score=n.score, refs=n.refs, hits=n.hits,
                                  last_access=n.last_access) for n in blocks.cache_table(query.tier, query.limit)]
            return CacheTable(entries=entries, total=blocks.cached_nodes())
        return await self._call(read)

    def cache_journal(self) -> tuple[CacheJournal, Callable[[Callable[[], Any]], Awaitable[Any]]]:
        return native_journal(self.engine.blocks), self._call

    @contextlib.asynccontextmanager
    async def registered(self, kvmeta: KvmetaClient) -> AsyncIterator[None]:
        self.handoff.kvmeta = kvmeta
        async with self.handoff.following(kvmeta):
            yield

    async def _call(self, work: Callable[[], Any]) -> Any:
        """`work` on the engine's thread, between two steps; its result."""
        return await asyncio.wrap_future(self.loop.call(lambda: (work(), None)))
