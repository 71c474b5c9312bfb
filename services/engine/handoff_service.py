"""The engine service's half of the KV hand-off (docs/serving.md): the data plane, the pulls a
decode engine's scheduler asks for, the leases of KV a prefill engine holds, and following the
registry so that connections to engines that left are dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from kvmesh.libs.controlplane import BadRequest
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import BlockLease

from .api import GenerateRequest
from .dataplane import KVDataPlane
from .engine import Engine, EngineLoop, Frame
from .factory import EngineConfig, device_pool_path
from .handoff import KVHandle
from .request import Request

log = logging.getLogger(__name__)


class KVHandoff:
    def __init__(self, config: EngineConfig, engine: Engine, loop: EngineLoop):
        self.config, self.engine, self.loop = config, engine, loop
        self.kvmeta: KvmetaClient | None = None
        self.dataplane = None
        if config.dataplane != "none" and config.role in ("prefill", "decode", "both"):
            self.dataplane = KVDataPlane(config.dataplane, config.token or "", config.data_host, config.data_port,
                                         config.role, engine.blocks.device.tensor, self._release,
                                         timeout=config.kv_timeout_ms / 1e3)
        self._main: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> KVHandoff:
        self._main = asyncio.get_running_loop()
        if self.dataplane is not None:
            self.engine.data_address = await self.dataplane.start()
            self.engine.on_pull = self._on_pull
            self.engine.on_kv_released = lambda request_id: self._main.call_soon_threadsafe(self._spawn, self._unlease(request_id))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.dataplane is not None:
            await self.dataplane.close()
        if self.config.dataplane == "shm":
            device_pool_path(self.config).unlink(missing_ok=True)

    def check(self, body: GenerateRequest, ids: list[int]) -> None:
        """400 for a hand-off this engine cannot do (its role, no data plane, a handle that does not fit)."""
        role = self.config.role
        if body.kv_transfer is not None and (role == "decode" or self.dataplane is None):
            raise BadRequest(f"kv_transfer: this engine ({role}, data plane {self.config.dataplane}) does not hand off KV")
        if body.kv_source is not None:
            if role == "prefill" or self.dataplane is None:
                raise BadRequest(f"kv_source: this engine ({role}, data plane {self.config.dataplane}) does not pull KV")
            body.kv_source.check(self.engine.blocks.num_layers, self.engine.blocks.block_size, len(ids) - 1)

    # decode role: the scheduler gave a request blocks; pull its KV into them

    def _on_pull(self, request: Request) -> None:
        """On the engine thread: snapshot where the KV goes, and pull on the service's loop."""
        handle = request.kv_source
        per_layer = -(-handle.num_tokens // handle.block_size)
        local = [list(layer.blocks[:per_layer]) for layer in request.layers]
        self._main.call_soon_threadsafe(self._spawn, self._pull(request.request_id, handle, local))

    async def _pull(self, request_id: str, handle: KVHandle, local: list[list[int]]) -> None:
        error, started = None, self.engine.clock()
        try:
            report = await self.dataplane.pull(handle, local)
            log.debug("pulled %s: %d bytes in %d reads, %.1f ms", request_id, report.bytes, report.reads_posted,
                      report.seconds * 1e3)
        except Exception as exc:  # any failure ends the request with an error frame, never a hang
            error = f"{type(exc).__name__}: {exc}"
        self.loop.submit(lambda: self.engine.pull_done(request_id, started, error))

    # prefill role: KV held for a decode engine

    async def _release(self, request_id: str) -> bool:
        """A decode engine's COMPLETE: free the blocks (on the engine thread)."""
        def release() -> tuple[bool, list[Frame]]:
            return self.engine.release_held(request_id), []
        return await asyncio.wrap_future(self.loop.call(release))

    def held(self, handle: KVHandle) -> None:
        """Record held KV in kvmeta's block map, so the cluster can see who holds what until when."""
        if self.kvmeta is not None:
            lease = BlockLease(engine=self.engine.engine_id, layers=handle.layers, token_count=handle.num_tokens,
                               lease_ms=self.config.kv_lease_ms)
            self._spawn(self.kvmeta.lease_blocks(handle.request_id, lease))

    async def _unlease(self, request_id: str) -> None:
        if self.kvmeta is not None:
            await self.kvmeta.release_blocks(request_id)

    # membership

    @contextlib.asynccontextmanager
    async def following(self, kvmeta: KvmetaClient) -> AsyncIterator[None]:
        """While open, drop the connection to any prefill engine the registry says left."""
        if self.dataplane is None or self.dataplane.puller is None:
            yield
            return
        task = asyncio.create_task(self._follow(kvmeta))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

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

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("KV hand-off task failed: %s", task.exception())
