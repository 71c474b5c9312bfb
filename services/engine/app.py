"""The engine service, on either backend (backend.py): `POST /v1/generate` (and its two phases,
`/v1/prefill` and `/v1/decode`) streams frames, `POST /v1/abort`, `GET /v1/state`, `GET /v1/steps`,
`PUT /v1/policy`, `POST /v1/kv/reserve`, `GET /v1/cache`, `GET /v1/tokenizer`; registers with kvmeta
and heartbeats its load when configured."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from kvmesh.libs.controlplane import BadRequest, Service
from kvmesh.libs.kvmeta.client import KvmetaClient, WorkerPresence
from kvmesh.libs.kvmeta.messages import Load, WorkerInfo
from kvmesh.libs.messages.engine import (AbortRequest, Aborted, CacheQuery, CacheTable, DecodeRequest, Frame,
                                         GenerateRequest, KVHandle, KVReserve, PolicyNames, PrefillRequest,
                                         TokenizerSpec)
from kvmesh.observability import tracing

from .backend import EngineBackend
from .cache_publisher import CachePublisher
from .config import EngineConfig
from .defaults import decided
from .frame_stream import write_frames
from .phases import trace_phases
from .state import EngineState
from .steps import EngineSteps, StepQuery

Config = EngineConfig

# Where each role's requests go; every backend serves all three with one handler.
GENERATION_ROUTES = (("/v1/generate", GenerateRequest, "Generate from a prompt, or either phase of one (by its body)"),
                     ("/v1/prefill", PrefillRequest, "Prefill a prompt and keep its KV for a decode engine"),
                     ("/v1/decode", DecodeRequest, "Decode a prompt whose KV a prefill engine holds"))


def build_backend(config: EngineConfig) -> EngineBackend:
    if config.backend == "vllm":
        from .vllm_backend.backend import VllmBackend
        return VllmBackend(config)
    from .native.backend import NativeBackend
    return NativeBackend(config)


class EngineRoutes:
    """The engine service's routes, one method each, and what they share: the backend, and the frame
    queue of each request streaming from it."""

    def __init__(self, config: EngineConfig, backend: EngineBackend):
        self.config = config
        self.backend = backend
        self.streams: dict[str, asyncio.Queue[Frame]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def on_frames(self, frames: list[Frame]) -> None:
        """From the backend's thread: the frames go to their streams on the event loop."""
        self._loop.call_soon_threadsafe(self._dispatch, frames)

    def _dispatch(self, frames: list[Frame]) -> None:
        for frame in frames:
            stream = self.streams.get(frame.request_id)
            if stream is not None:
                stream.put_nowait(frame)

    async def run_engine(self, app: web.Application) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        config, backend = self.config, self.backend
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(backend)  # before requests come: handles carry its data address
            if config.kvmeta_url:
                kvmeta = await stack.enter_async_context(KvmetaClient(config.kvmeta_url, config.token))
                republish = None
                if (journal := backend.cache_journal()) is not None:
                    publisher = await stack.enter_async_context(CachePublisher(kvmeta, config.engine_id, *journal))
                    republish = publisher.republish
                await stack.enter_async_context(WorkerPresence(kvmeta, _worker_info(config, backend),
                                                               ttl_ms=config.heartbeat_ttl_ms,
                                                               load=lambda: _load(backend.state()),
                                                               on_register=republish))
                await stack.enter_async_context(backend.registered(kvmeta))
            yield

    async def end_streams(self) -> None:
        """Abort what is running, so every open stream ends with finish_reason `abort`."""
        await self.backend.abort_all(list(self.streams))

    async def generate(self, request: web.Request, body: GenerateRequest) -> web.StreamResponse:
        """Generate from a prompt; streams one frame per step's new tokens (msgpack, or JSON lines on
        Accept: JSON)."""
        backend = self.backend
        arrival = backend.clock()
        ids, sampling = body.validated(backend.tokenizer, backend.vocab_size, backend.context_limit)
        targets = body.targets
        targets.check()
        if tracing.enabled():
            tracing.annotate({f"kvmesh.{name}": getattr(targets, name) for name in targets.__struct_fields__})
        request_id = body.request_id or uuid.uuid4().hex
        if request_id in self.streams:
            raise BadRequest(f"request {request_id} is already running on this engine")
        frames: asyncio.Queue[Frame] = asyncio.Queue()
        self.streams[request_id] = frames  # before the engine can produce the first frame
        try:
            await backend.add(request_id, body, ids, sampling, arrival)
        except BaseException:
            self.streams.pop(request_id, None)
            raise
        response, last = web.StreamResponse(), None
        try:
            last = await write_frames(request, frames, response,
                                      on_last=lambda frame: trace_phases(frame, self.config.engine_id,
                                                                         self.config.role))
        finally:
            self.streams.pop(request_id, None)
            backend.ended(request_id, last)
        return response

    async def abort(self, request: web.Request, body: AbortRequest) -> Aborted:
        """Stop a request and free its blocks; its stream ends with finish_reason `abort`."""
        return Aborted(aborted=await self.backend.abort(body.request_id))

    async def state(self, request: web.Request) -> EngineState:
        """Free blocks per tier, queue lengths, KV held for or pulled from other engines, recent time
        between tokens."""
        return self.backend.state()

    async def steps(self, request: web.Request, query: StepQuery) -> EngineSteps:
        """The latest steps (a bounded ring), each with its shape and the wall time of the engine loop's
        turn around it: what the simulator's step cost is fitted to (kvmesh sim calibrate --from-engine)."""
        return self.backend.steps(query.since)

    async def cache(self, request: web.Request, query: CacheQuery) -> CacheTable:
        """CaR's cache table: the prefix cache's nodes with their tier, blocks, size and score."""
        return await self.backend.cache_table(query)

    async def reserve(self, request: web.Request, body: KVReserve) -> KVHandle:
        """Push mode: reserve blocks for a prompt's KV that a prefill engine will write; answers where,
        once this engine's allocation policy gives them (the request then waits here, not in prefill)."""
        backend = self.backend
        if body.num_tokens >= backend.context_limit:
            raise BadRequest(f"kv/reserve: {body.num_tokens} tokens is over this engine's context limit of "
                             f"{backend.context_limit}")
        return await backend.reserve(body.request_id, body.num_tokens)

    async def tokenizer(self, request: web.Request) -> TokenizerSpec:
        """The model's tokenizer, chat template and context limit (admission tokenizes with it)."""
        return self.backend.tokenizer_spec

    async def set_policy(self, request: web.Request, body: PolicyNames) -> PolicyNames:
        """Switch engine-level policies by name, between two steps."""
        try:
            return PolicyNames(policies=await self.backend.set_policies(body.policies))
        except KeyError as exc:
            raise BadRequest(str(exc.args[0])) from None


def build_service(config: EngineConfig) -> Service:
    config = decided(config)
    backend = build_backend(config)
    service = Service("engine", config)
    engine = EngineRoutes(config, backend)
    backend.start(engine.on_frames)
    service.metrics.register(backend.collector(backend.state, config.engine_id, config.role))
    service.lifespan(engine.run_engine)
    service.on_shutdown(engine.end_streams)

    for path, body_type, summary in GENERATION_ROUTES:
        service.route("POST", path, body=body_type, summary=summary)(engine.generate)
    service.route("POST", "/v1/abort", body=AbortRequest, response=Aborted)(engine.abort)
    service.route("GET", "/v1/state", response=EngineState)(engine.state)
    service.route("GET", "/v1/steps", query=StepQuery, response=EngineSteps)(engine.steps)
    service.route("GET", "/v1/cache", query=CacheQuery, response=CacheTable)(engine.cache)
    service.route("POST", "/v1/kv/reserve", body=KVReserve, response=KVHandle)(engine.reserve)
    service.route("GET", "/v1/tokenizer", response=TokenizerSpec)(engine.tokenizer)
    service.route("PUT", "/v1/policy", body=PolicyNames, response=PolicyNames)(engine.set_policy)
    return service


def _worker_info(config: EngineConfig, backend: EngineBackend) -> WorkerInfo:
    return WorkerInfo(id=config.engine_id, role=config.role, model=config.model, backend=backend.name,
                      control_url=config.advertise_url or f"http://{config.host}:{config.port}",
                      data_address=backend.data_address, pairing=backend.pairing, geometry=backend.geometry,
                      capacity=backend.capacity)


def _load(state: EngineState) -> Load:
    return Load(free_blocks=state.free_blocks, waiting=state.waiting, running=state.running, swapped=state.swapped)
