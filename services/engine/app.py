"""The engine service: `POST /v1/generate` (and its two phases, `/v1/prefill` and `/v1/decode`)
streams frames, `POST /v1/abort`, `GET /v1/state`, `PUT /v1/policy`; registers with kvmeta and
heartbeats its load when configured."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from kvmesh.libs.controlplane import BadRequest, Service
from kvmesh.libs.kvmeta.client import KvmetaClient, WorkerPresence
from kvmesh.libs.kvmeta.messages import BlockGeometry, Capacity, GpuNic, Load, WorkerInfo
from kvmesh.observability import tracing

from .api import (GENERATION_ROUTES, Aborted, AbortRequest, CacheEntry, CacheQuery, CacheTable, GenerateRequest,
                  PolicyNames, TokenizerSpec)
from .cache_publisher import CachePublisher, native_journal
from .engine import EngineLoop, EngineState, Frame
from .frame_stream import write_frames
from .data_link import DataLink
from .factory import EngineConfig, build_engine, decided, max_model_len
from .handoff import KVHandle, KVReserve
from .handoff_service import KVHandoff
from .metrics import NativeEngineCollector
from .phases import trace_phases

Config = EngineConfig


def build_service(config: EngineConfig) -> Service:
    config = decided(config)
    if config.backend == "vllm":
        from .vllm_backend.service import build_service as build_vllm_service
        return build_vllm_service(config)
    service = Service("engine", config)
    loop = EngineLoop(lambda: build_engine(config), lambda frames: main_loop.call_soon_threadsafe(dispatch, frames))
    engine = loop.start()
    context_limit = max_model_len(config, engine)
    model_config = engine.runner.model.config
    streams: dict[str, asyncio.Queue[Frame]] = {}
    main_loop: asyncio.AbstractEventLoop | None = None

    def dispatch(frames: list[Frame]) -> None:
        for frame in frames:
            if frame.kv_handle is not None:
                handoff.held(frame.kv_handle)
            stream = streams.get(frame.request_id)
            if stream is not None:
                stream.put_nowait(frame)

    handoff = KVHandoff(config, engine, loop)
    service.metrics.register(NativeEngineCollector(lambda: loop.state, config.engine_id, config.role))

    @service.lifespan
    async def run_engine(app: web.Application) -> AsyncIterator[None]:
        nonlocal main_loop
        main_loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(handoff)  # before requests come: handles carry its address
            stack.push_async_callback(asyncio.to_thread, loop.stop)  # stepping stops before the data plane closes
            if config.kvmeta_url:
                kvmeta = await stack.enter_async_context(KvmetaClient(config.kvmeta_url, config.token))
                handoff.kvmeta = kvmeta
                publisher = await stack.enter_async_context(CachePublisher(
                    kvmeta, config.engine_id, native_journal(engine.blocks),
                    lambda read: asyncio.wrap_future(loop.call(lambda: (read(), [])))))
                await stack.enter_async_context(WorkerPresence(kvmeta, _worker_info(config, engine, handoff.link),
                                                               ttl_ms=config.heartbeat_ttl_ms,
                                                               load=lambda: _load(loop.state),
                                                               on_register=publisher.republish))
                await stack.enter_async_context(handoff.following(kvmeta))
            yield

    @service.on_shutdown
    async def end_streams() -> None:
        """Abort what is running, so every open stream ends with finish_reason `abort`."""
        def abort_all() -> tuple[None, list[Frame]]:
            return None, [frame for request_id in list(streams) for frame in engine.abort(request_id)]
        await asyncio.wrap_future(loop.call(abort_all))

    async def generate(request: web.Request, body: GenerateRequest) -> web.StreamResponse:
        """Generate from a prompt; streams one frame per token (msgpack, or JSON lines on Accept: JSON)."""
        arrival = engine.clock()
        ids, sampling = body.validated(engine.tokenizer, model_config.vocab_size, context_limit)
        targets = body.targets()
        if tracing.enabled():
            tracing.annotate({"kvmesh.ttft_slo_ms": targets.ttft_slo_ms, "kvmesh.tbt_slo_ms": targets.tbt_slo_ms,
                              "kvmesh.predicted_output_len": targets.predicted_output_len,
                              "kvmesh.predicted_output_low": targets.predicted_output_low,
                              "kvmesh.predicted_output_median": targets.predicted_output_median})
        request_id = body.request_id or uuid.uuid4().hex
        if request_id in streams:
            raise BadRequest(f"request {request_id} is already running on this engine")
        handoff.check(body, ids)
        push = await handoff.push_for(body)
        frames: asyncio.Queue[Frame] = asyncio.Queue()
        streams[request_id] = frames  # before the engine can produce the first frame
        if body.kv_transfer is not None:
            handoff.traced(request_id)
        if handoff.claims(body):  # push mode: the KV is already in blocks reserved here
            def claim() -> tuple[bool, list[Frame]]:
                return engine.claim(request_id, ids, sampling, arrival, targets), []
            if not await asyncio.wrap_future(loop.call(claim)):
                streams.pop(request_id, None)
                raise BadRequest(f"kv_source: no reservation {request_id} for {len(ids) - 1} tokens on this engine "
                                 "(expired, or never made)")
        else:
            def add() -> None:
                engine.add(request_id, ids, sampling, hold_kv=body.kv_transfer is not None and push is None,
                           push=push, kv_source=body.kv_source, arrival=arrival, targets=targets)
            loop.submit(add)
        response, last = web.StreamResponse(), None
        try:
            last = await write_frames(request, frames, response,
                                      on_last=lambda frame: trace_phases(frame, config.engine_id, config.role))
        finally:
            streams.pop(request_id, None)
            if last is None or last.kv_handle is None:
                handoff.untraced(request_id)
            if last is None:  # the client went away: free the request's blocks now
                loop.submit(lambda: engine.abort(request_id))
        return response

    for path, body_type, summary in GENERATION_ROUTES:
        service.route("POST", path, body=body_type, summary=summary)(generate)

    @service.route("POST", "/v1/abort", body=AbortRequest, response=Aborted)
    async def abort(request: web.Request, body: AbortRequest) -> Aborted:
        """Stop a request and free its blocks; its stream ends with finish_reason `abort`."""
        def stop() -> tuple[bool, list[Frame]]:
            frames = engine.abort(body.request_id)
            return engine.release_held(body.request_id) or bool(frames), frames
        return Aborted(aborted=await asyncio.wrap_future(loop.call(stop)))

    @service.route("GET", "/v1/state", response=EngineState)
    async def state(request: web.Request) -> EngineState:
        """Free blocks per tier, queue lengths, recent time between tokens."""
        return loop.state

    @service.route("GET", "/v1/cache", query=CacheQuery, response=CacheTable)
    async def cache(request: web.Request, query: CacheQuery) -> CacheTable:
        """CaR's cache table: the prefix cache's nodes with their tier, blocks, size and score."""
        def read() -> tuple[CacheTable, list[Frame]]:
            blocks = engine.blocks
            entries = [CacheEntry(node_id=n.node_id, tier=n.tier, blocks=list(n.blocks), size_bytes=blocks.node_bytes(n),
                                  valid_in_gpu=n.tier == "device", score=n.score, refs=n.refs, hits=n.hits,
                                  last_access=n.last_access) for n in blocks.cache_table(query.tier, query.limit)]
            return CacheTable(entries=entries, total=blocks.cached_nodes()), []
        return await asyncio.wrap_future(loop.call(read))

    tokenizer_spec = _tokenizer_spec(config, engine, context_limit)

    @service.route("POST", "/v1/kv/reserve", body=KVReserve, response=KVHandle)
    async def reserve(request: web.Request, body: KVReserve) -> KVHandle:
        """Push mode: reserve blocks for a prompt's KV that a prefill engine will write; answers where,
        once this engine's allocation policy gives them (the request then waits here, not in prefill)."""
        if body.num_tokens >= context_limit:
            raise BadRequest(f"kv/reserve: {body.num_tokens} tokens is over this engine's context limit of {context_limit}")
        return await handoff.reserve(body.request_id, body.num_tokens)

    @service.route("GET", "/v1/tokenizer", response=TokenizerSpec)
    async def tokenizer(request: web.Request) -> TokenizerSpec:
        """The model's tokenizer, chat template and context limit (admission tokenizes with it)."""
        return tokenizer_spec

    @service.route("PUT", "/v1/policy", body=PolicyNames, response=PolicyNames)
    async def set_policy(request: web.Request, body: PolicyNames) -> PolicyNames:
        """Switch engine-level policies by name, between two steps."""
        def switch() -> tuple[dict[str, str], list[Frame]]:
            if body.policies.get("layer_offload", "none") != "none" and not engine.scheduler.staging_cap:
                raise KeyError("layer_offload needs a cxl tier to offload to: start the engine with cxl_blocks "
                               "or cxl_bytes")
            engine.scheduler.policies.set(body.policies)
            return dict(engine.scheduler.policies.names), []
        try:
            return PolicyNames(policies=await asyncio.wrap_future(loop.call(switch)))
        except KeyError as exc:
            raise BadRequest(str(exc.args[0])) from None

    return service


def _worker_info(config: EngineConfig, engine, link: DataLink | None) -> WorkerInfo:
    spec = engine.runner.model.config
    blocks = engine.blocks
    return WorkerInfo(
        id=config.engine_id, role=config.role, control_url=config.advertise_url or f"http://{config.host}:{config.port}",
        model=config.model, data_address=engine.data_address,
        pairing=[GpuNic(gpu=link.gpu, nic=link.nic, address=engine.data_address)] if link and engine.data_address else [],
        geometry=BlockGeometry(block_size=blocks.block_size, num_layers=spec.num_layers,
                               num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=config.dtype),
        capacity=Capacity(device_blocks=blocks.device.num_blocks,
                          cxl_blocks=blocks.pools["cxl"].num_blocks if "cxl" in blocks.pools else 0))


def _tokenizer_spec(config: EngineConfig, engine, context_limit: int) -> TokenizerSpec:
    tok = engine.tokenizer
    special = {name: value for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if isinstance(value := getattr(tok, name, None), str)}
    return TokenizerSpec(model=config.model, tokenizer_json=tok.backend_tokenizer.to_str(),
                         chat_template=getattr(tok, "chat_template", None), special_tokens=special,
                         eos_token_ids=list(engine.eos_token_ids), max_model_len=context_limit)


def _load(state: EngineState) -> Load:
    return Load(free_blocks=state.free_blocks, waiting=state.waiting, running=state.running, swapped=state.swapped)
