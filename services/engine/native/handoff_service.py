"""The engine service's half of the KV hand-off (docs/serving.md): the data plane, the pulls a
decode engine's scheduler asks for, the leases of KV a prefill engine holds, and following the
registry so that connections to engines that left are dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import numpy as np
from opentelemetry.context import Context

from kvmesh.libs.controlplane import BadRequest, ServiceUnavailable, cancel_and_wait
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import BlockLease
from kvmesh.libs.messages.engine import GenerateRequest, KVHandle, TransferStats
from kvmesh.libs.rdma.kvdirect.node import KVDirectNode
from kvmesh.libs.rdma.kvdirect.puller import BlockReads
from kvmesh.libs.rdma.kvdirect.pusher import LayerPush
from kvmesh.libs.rdma.work import RdmaError
from kvmesh.observability import tracing

from ..config import EngineConfig
from ..data_link import DataLink, data_link
from .engine import Engine
from .engine_loop import EngineLoop
from .events import EngineEvents, PullOrder
from .factory import shm_pool_paths

log = logging.getLogger(__name__)

POOL = "device"  # where pulled or pushed KV lands, and pushed KV leaves from


class KVHandoff:
    def __init__(self, config: EngineConfig, engine: Engine, loop: EngineLoop):
        self.config, self.engine, self.loop = config, engine, loop
        self.kvmeta: KvmetaClient | None = None
        self.dataplane = None
        self.link: DataLink | None = None
        if config.dataplane != "none" and config.role in ("prefill", "decode", "both"):
            self.link = data_link(config)
            # Peers read any tier our held KV is in; pulled and pushed KV lands in (and leaves) the device tier.
            pools = {t: p.tensor for t, p in engine.blocks.pools.items()}
            self.dataplane = KVDirectNode(config.dataplane, config.token or "", self.link.host, config.data_port,
                                          served=pools, landing={POOL: pools[POOL]}, release=self._release,
                                          timeout=config.kv_timeout_ms / 1e3, options=self.link.options)
        self._main: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._traces: dict[str, Context] = {}  # prefill role: request id -> its trace, while its KV is held
        self._reservations: dict[str, asyncio.Future[list[list[int]]]] = {}

    async def __aenter__(self) -> KVHandoff:
        self._main = asyncio.get_running_loop()
        if self.dataplane is not None:
            self.engine.data_address = await self.dataplane.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.dataplane is not None:
            await self.dataplane.close()
        for path in shm_pool_paths(self.config).values():
            path.unlink(missing_ok=True)

    def check(self, body: GenerateRequest, ids: list[int]) -> None:
        """400 for a hand-off this engine cannot do (its role, no data plane, a handle that does not fit)."""
        role, blocks = self.config.role, self.engine.blocks
        transfer = body.kv_transfer
        if transfer is not None:
            if role == "decode" or self.dataplane is None:
                raise BadRequest(f"kv_transfer: this engine ({role}, data plane {self.config.dataplane}) does not hand off KV")
            if (transfer.mode == "push") != (transfer.target is not None):
                raise BadRequest("kv_transfer: push mode needs a `target` (a decode engine's reservation), pull mode none")
            if transfer.target is not None:
                transfer.target.check(blocks.num_layers, blocks.block_size, len(ids))
        if body.kv_source is not None:
            if role == "prefill" or self.dataplane is None:
                raise BadRequest(f"kv_source: this engine ({role}, data plane {self.config.dataplane}) does not pull KV")
            body.kv_source.check(blocks.num_layers, blocks.block_size, len(ids) - 1)

    def claims(self, body: GenerateRequest) -> bool:
        """Whether the request's KV was pushed into blocks this engine reserved (rather than pulled)."""
        return body.kv_source is not None and body.kv_source.engine == self.engine.engine_id

    async def push_for(self, body: GenerateRequest) -> LayerPush | None:
        """Push mode: a push to the target's engine, connected before the prefill starts. Once its writes
        have landed the engine, between two steps, sends the first token (or an error) and frees the blocks."""
        target = body.kv_transfer.target if body.kv_transfer is not None else None
        if target is None:
            return None
        try:
            push = await self.dataplane.push(target.data_address, POOL, target.layers)
        except RdmaError as exc:
            raise ServiceUnavailable(f"cannot reach the decode engine {target.engine} at {target.data_address}: {exc}") from None
        push.landed.add_done_callback(
            lambda _: self.loop.submit(lambda: EngineEvents(frames=self.engine.pushes_landed())))
        return push

    async def reserve(self, request_id: str, num_tokens: int) -> KVHandle:
        """Push mode, decode role: blocks for `num_tokens` tokens of KV, once the allocation policy gives them."""
        if self.config.role == "prefill" or self.dataplane is None:
            raise BadRequest(f"kv/reserve: this engine ({self.config.role}, data plane {self.config.dataplane}) "
                             "does not take pushed KV")
        if request_id in self._reservations:
            raise BadRequest(f"blocks are already being reserved for {request_id}")
        ready = self._reservations[request_id] = self._main.create_future()

        def queue() -> None:
            self.engine.reserve(request_id, num_tokens)
        self.loop.submit(queue)
        try:
            layers = await ready
        finally:
            self._reservations.pop(request_id, None)
        return KVHandle(engine=self.engine.engine_id, data_address=self.engine.data_address, request_id=request_id,
                        num_tokens=num_tokens, block_size=self.engine.blocks.block_size, layers=layers)

    def on_events(self, events: EngineEvents) -> None:
        """On the engine thread: what a step or a command asks of the hand-off, done on the service's loop."""
        if self.kvmeta is not None:
            for frame in events.frames:
                if frame.kv_handle is not None:
                    self._main.call_soon_threadsafe(self._lease, frame.kv_handle)
        for order in events.pulls:
            self._main.call_soon_threadsafe(self._pull_or_reserved, order)
        for request_id in events.released:
            self._main.call_soon_threadsafe(self._released, request_id)

    # decode role: the scheduler gave a request blocks; pull its KV into them

    def _pull_or_reserved(self, order: PullOrder) -> None:
        if order.source is not None:
            self._spawn(self._pull(order.request_id, order.source, order.local))
            return
        ready = self._reservations.get(order.request_id)  # push mode: the caller of kv/reserve pushes
        if ready is not None and not ready.done():
            ready.set_result(order.local)

    async def _pull(self, request_id: str, handle: KVHandle, local: list[list[int]]) -> None:
        error, started, stats = None, self.engine.clock(), None
        try:
            report = await self.dataplane.pull(handle.data_address, request_id, _reads(handle, local))
            stats = TransferStats(bytes=report.bytes, pieces=report.pieces, reads_posted=report.reads_posted,
                                  seconds=report.seconds, backend=self.dataplane.transport, peer=handle.data_address)
            log.debug("pulled %s: %d bytes in %d reads, %.1f ms", request_id, report.bytes, report.reads_posted,
                      report.seconds * 1e3)
        except Exception as exc:  # any failure ends the request with an error frame, never a hang
            error = f"{type(exc).__name__}: {exc}"
        self.loop.submit(lambda: EngineEvents(frames=self.engine.pull_done(request_id, started, error, stats)))

    # prefill role: KV held for a decode engine

    async def _release(self, request_id: str) -> bool:
        """A decode engine's COMPLETE: the blocks are freed on the engine thread between two steps,
        but the ACK goes now. Waiting for the engine thread would hold every COMPLETE queued behind
        this one (one is in flight per connection) for the rest of a prefill step, tens of ms."""
        if request_id not in self.engine.held:  # a dict lookup; the engine thread only adds and removes
            return False
        self.loop.submit(lambda: self.engine.release_held(request_id))
        return True

    def _lease(self, handle: KVHandle) -> None:
        """Record held KV in kvmeta's block map, so the cluster can see who holds what until when
        (queued before the frame with the handle reaches its stream)."""
        lease = BlockLease(engine=self.engine.engine_id, layers=handle.layers, token_count=handle.num_tokens,
                           lease_ms=self.config.kv_lease_ms)
        self._spawn(self.kvmeta.lease_blocks(handle.request_id, lease), self._traces.get(handle.request_id))

    def traced(self, request_id: str) -> None:
        """Prefill role: the kvmeta calls about this request's held KV go on its trace."""
        if (captured := tracing.captured()) is not None:
            self._traces[request_id] = captured

    def untraced(self, request_id: str) -> None:
        """The request ended holding no KV: nothing more goes on its trace from here."""
        self._traces.pop(request_id, None)

    async def _unlease(self, request_id: str) -> None:
        if self.kvmeta is not None:
            await self.kvmeta.release_blocks(request_id)

    # membership

    @contextlib.asynccontextmanager
    async def following(self, kvmeta: KvmetaClient) -> AsyncIterator[None]:
        """While open, drop the connection to any prefill engine the registry says left."""
        if self.dataplane is None:
            yield
            return
        task = asyncio.create_task(self._follow(kvmeta))
        try:
            yield
        finally:
            await cancel_and_wait([task])

    async def _follow(self, kvmeta: KvmetaClient) -> None:
        addresses: dict[str, str] = {}
        async for event in kvmeta.watch():
            if event.kind == "snapshot":
                addresses = {w.info.id: w.info.data_address for w in event.workers or []}
            elif event.kind == "join" and event.worker is not None:
                addresses[event.worker.id] = event.worker.data_address
            elif event.kind == "leave" and event.worker_id in addresses:
                address = addresses.pop(event.worker_id)
                if address:
                    log.info("%s left (%s): dropping its connection", event.worker_id, event.reason)
                    await self.dataplane.forget(address)

    def _released(self, request_id: str) -> None:
        self._spawn(self._unlease(request_id), self._traces.pop(request_id, None))

    def _spawn(self, coroutine, trace: Context | None = None) -> None:
        task = tracing.task_in(trace, coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("KV hand-off task failed: %s", task.exception())


def _reads(handle: KVHandle, local: list[list[int]]) -> list[BlockReads]:
    """The reads that bring the handle's blocks into ours, `local[layer]`: one batch per tier of the
    peer's that its layers are in (LayerKV may have offloaded some to its cxl tier)."""
    tiers = handle.tiers or [POOL] * len(handle.layers)
    reads = []
    for tier in sorted(set(tiers)):
        layers = [i for i, t in enumerate(tiers) if t == tier]
        remote = np.concatenate([np.asarray(handle.layers[i][:len(local[i])], dtype=np.int64) for i in layers])
        mine = np.concatenate([np.asarray(local[i], dtype=np.int64) for i in layers])
        reads.append(BlockReads(tier, POOL, remote, mine))
    return reads
