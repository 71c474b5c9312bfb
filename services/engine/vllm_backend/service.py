"""The engine service on stock vLLM (`backend = "vllm"`, docs/vllm.md): the native engine's HTTP API
(`POST /v1/generate`, `/v1/prefill` and `/v1/decode`, `/v1/abort`, `/v1/state`, `/v1/tokenizer`),
its registration and heartbeats in kvmeta, so that admission and the scheduler cannot tell the
backends apart. Prefill engines run vLLM with KVMeshConnector as producer, decode engines as
consumer; the connector's kv_transfer_params travel as kvmesh's KVHandle.

With `prefix_cache_cxl` the connector also keeps prefix blocks in a cxl tier of `cxl_blocks` (or
`cxl_bytes`) in host memory, on any role (a colocated engine runs it as kv_both without a data plane).
What only the native engine has is refused with a 400 or a config error that says so: push mode,
engine policies other than KVMeshScheduler's, LayerKV's offload, CaR's sparsification.
Run it with a Python that has vLLM: `.venv-vllm/bin/python -m kvmesh serve engine` on CPU here.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
from aiohttp import web

from kvmesh.infra.local.processes import free_port
from kvmesh.libs.controlplane import BadRequest, ConfigError, Service
from kvmesh.libs.kvmeta.client import KvmetaClient, WorkerPresence
from kvmesh.libs.kvmeta.messages import BlockGeometry, CacheEntry, Capacity, GpuNic, Load, WorkerInfo
from kvmesh.policies.scheduling import PrefillCost

from ..api import GENERATION_ROUTES, Aborted, AbortRequest, GenerateRequest, PolicyNames, TokenizerSpec
from ..cache_publisher import CacheJournal, CachePublisher
from ..data_link import data_link
from ..engine import Frame, Timings, TransferTotals, Usage
from ..factory import EngineConfig, allocation_params
from ..frame_stream import write_frames
from ..handoff import KVHandle, TransferStats
from ..kv_pool import BlockShape
from ..metrics import EngineCollector
from ..model_source import resolve_model
from ..models import save_preset_checkpoint
from ..phases import trace_phases
from ..sampling import SamplingParams
from .engine_thread import VllmThread
from .host_table import HostTable
from .policy_hooks import HOOKS, TARGETS
from .prefill_profile import profile_prefill_cost

CONNECTOR = dict(kv_connector="KVMeshConnector", kv_connector_module_path="kvmesh.services.engine.vllm_backend.connector")
SCHEDULER = "kvmesh.services.engine.vllm_backend.scheduler.KVMeshScheduler"
CPU_BLOCK_MULTIPLE = 32   # vLLM's CPU attention wants blocks of a multiple of 32 tokens
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


class VllmEngineState(msgspec.Struct, kw_only=True):
    """`GET /v1/state` on the vLLM backend: the native engine's queue and block counts (vLLM's own pool)."""

    backend: str
    free_blocks: dict[str, int]
    total_blocks: dict[str, int]
    waiting: int
    running: int
    swapped: int
    pulling: int    # decode role: requests whose KV is being pulled
    held_kv: int    # prefill role: finished requests whose KV waits for a decode engine
    policies: dict[str, str]               # KVMeshScheduler's, by hook
    prefill_cost: PrefillCost | None       # LayerKV Eq. 3's fit on this engine; None: not profiled
    prefills_held_back: int                # all time: waiting requests the admission or allocation policy kept out of a step
    preemptions: dict[str, int]            # all time, by strategy: vLLM only recomputes
    unallocated_tokens: int                # KV allotted to nobody, the reservation left out (CacheOpt 3.3)
    allocations_grown: dict[str, int]      # all time: allocations a request outgrew, grown from where
    recent_preemptions: list[str]          # the latest victims, oldest first: vLLM's ids (ours, "-" and its suffix)
    generated_tokens: int                  # all time
    computed_prompt_tokens: int            # of finished requests' prompts, tokens computed here
    prefix_cache_hit_tokens: int           # and those not: vLLM's cached tokens (its prefix cache, and KV pulled)
    kv_transfer: TransferTotals            # decode role: the KV pulls, all time
    # The cxl tier (prefix_cache_cxl), by tier as on the native engine: full blocks looked up there and
    # found (all time), nodes it holds, nodes and bytes moved (cxl: saved to it, device: loaded back).
    prefix_cache_lookup_blocks: dict[str, int] = {}
    prefix_cache_hit_blocks: dict[str, int] = {}
    prefix_cache_nodes: dict[str, int] = {}
    prefix_cache_moved_nodes: dict[str, int] = {}
    prefix_cache_moved_bytes: dict[str, int] = {}


@dataclass
class Tracked:
    """A request on this engine, from its arrival to its last frame."""

    prompt_tokens: int
    arrival: float
    hands_off: bool                     # prefill role: its KV goes to a decode engine
    first_token: float | None = None
    completion_tokens: int = 0
    logprobs: bool = False
    vllm_id: str = ""                   # vLLM's id for it: ours with a suffix of its own


@dataclass
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int


@dataclass
class Counters:
    """Kept on the engine's thread; `state` is replaced whole after each step, read by HTTP and scrapes."""

    state: VllmEngineState | None = None
    generated_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    tracked: dict[str, Tracked] = field(default_factory=dict)


def build_service(config: EngineConfig) -> Service:
    _refuse_native_only(config)
    service = Service("engine", config)
    model_dir, scratch = _checkpoint(config)
    link = data_link(config) if config.role in ("prefill", "decode") and config.dataplane != "none" else None
    data_port = config.data_port or (free_port(link.host) if link and config.role == "prefill" else 0)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    geometry = _geometry(hf_config)
    max_model_len = kv_context_limit(config, geometry, hf_config.max_position_embeddings)
    cxl_blocks = cxl_tier_blocks(config, geometry)
    counters = Counters()
    streams: dict[str, asyncio.Queue[Frame]] = {}
    main_loop: asyncio.AbstractEventLoop | None = None

    def build_engine():
        _vllm_environment(config)
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        transfer = None
        if link is not None or cxl_blocks:
            settings = {"handoff": link is not None, "cxl_blocks": cxl_blocks, "model": config.model}
            if link is not None:
                settings.update(backend=config.dataplane, token=config.token, data_host=link.host, data_port=data_port,
                                lease_s=config.kv_lease_ms / 1e3, timeout_s=config.kv_timeout_ms / 1e3,
                                endpoint=link.options)
            transfer = KVTransferConfig(**CONNECTOR, engine_id=config.engine_id, kv_load_failure_policy="recompute",
                                        kv_role=KV_ROLES[config.role], kv_connector_extra_config=settings)
        args = EngineArgs(model=str(model_dir), dtype=config.dtype, seed=config.seed, block_size=config.block_size,
                          max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=max(config.token_budget, config.max_model_len),
                          enable_prefix_caching=config.prefix_caching, enforce_eager=True,
                          kv_cache_memory_bytes=config.device_bytes, disable_log_stats=True,
                          kv_transfer_config=transfer, scheduler_cls=SCHEDULER,
                          additional_config={"kvmesh": {"policies": dict(config.policies),
                                                       "allocation": dataclasses.asdict(allocation_params(config))}})
        built = LLMEngine.from_engine_args(args)
        if config.layer_profile == "on" or (config.layer_profile == "auto"
                                            and config.policies.get("prefill_admission") == "layerkv"):
            _scheduler(built).prefill_cost = profile_prefill_cost(
                built, model_dir, geometry.hidden_size, geometry.vocab_size, getattr(torch, config.dtype),
                min(built.model_config.max_model_len // 2, 512), repeats=2)
        return built

    def on_outputs(outputs: list) -> None:  # on the engine's thread
        frames = [_frame(output, counters, config, geometry, block_size, engine.engine) for output in outputs]
        main_loop.call_soon_threadsafe(dispatch, frames)

    def dispatch(frames: list[Frame]) -> None:
        for frame in frames:
            stream = streams.get(frame.request_id)
            if stream is not None:
                stream.put_nowait(frame)

    engine = VllmThread(build_engine, on_outputs, observe=lambda e: _observe(e, counters))
    service.metrics.register(EngineCollector(lambda: counters.state, config.engine_id, config.role))
    engine.start()
    block_size = engine.engine.vllm_config.cache_config.block_size
    context_limit = engine.engine.model_config.max_model_len
    total_blocks = counters.state.total_blocks["device"]
    tokenizer_spec = _tokenizer_spec(config, model_dir, tokenizer, context_limit)

    @service.lifespan
    async def run_engine(app: web.Application) -> AsyncIterator[None]:
        nonlocal main_loop
        main_loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(asyncio.to_thread, engine.stop)
            if scratch is not None:
                stack.callback(shutil.rmtree, scratch, True)
            if config.kvmeta_url:
                kvmeta = await stack.enter_async_context(KvmetaClient(config.kvmeta_url, config.token))
                data_address = f"{link.host}:{data_port}" if link and config.role == "prefill" else ""
                info = WorkerInfo(
                    id=config.engine_id, role=config.role, model=config.model, data_address=data_address,
                    control_url=config.advertise_url or f"http://{config.host}:{config.port}",
                    pairing=[GpuNic(gpu=link.gpu, nic=link.nic, address=data_address)] if data_address else [],
                    geometry=BlockGeometry(block_size=block_size, num_layers=geometry.num_layers,
                                           num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                                           dtype=config.dtype),
                    capacity=Capacity(device_blocks=total_blocks), backend="vllm")
                republish = None
                table = _scheduler(engine.engine).connector.table if cxl_blocks else None
                if table is not None:   # the cxl tier's nodes, for the scheduler's prefix-aware routing
                    on_engine = lambda read: asyncio.wrap_future(engine.call(lambda e: read()))  # noqa: E731
                    publisher = await stack.enter_async_context(CachePublisher(
                        kvmeta, config.engine_id, _tier_journal(table, _worker_connector().tier.slot_bytes), on_engine))
                    republish = publisher.republish
                await stack.enter_async_context(WorkerPresence(kvmeta, info, ttl_ms=config.heartbeat_ttl_ms,
                                                               load=lambda: _load(counters.state),
                                                               on_register=republish))
            yield

    @service.on_shutdown
    async def end_streams() -> None:
        """Abort what is running, so every open stream ends with finish_reason `abort`."""
        dispatch(await asyncio.wrap_future(engine.call(lambda e: [f for r in list(streams)
                                                                  for f in _abort(e, r, counters.tracked)])))

    async def generate(request: web.Request, body: GenerateRequest) -> web.StreamResponse:
        """Generate from a prompt; streams one frame per step's new tokens (msgpack, or JSON lines)."""
        arrival = time.time()
        ids, sampling = body.validated(tokenizer, geometry.vocab_size, context_limit)
        targets = {name: value for name, value in dataclasses.asdict(body.targets()).items() if value is not None}
        params = _transfer_params(config, body, ids, geometry.num_layers, block_size)
        request_id = body.request_id or uuid.uuid4().hex
        if request_id in streams:
            raise BadRequest(f"request {request_id} is already running on this engine")
        frames: asyncio.Queue[Frame] = asyncio.Queue()
        streams[request_id] = frames

        def add(e) -> None:
            tracked = Tracked(len(ids), arrival, body.kv_transfer is not None, logprobs=sampling.logprobs)
            counters.tracked[request_id] = tracked
            tracked.vllm_id = e.add_request(request_id, {"prompt_token_ids": ids},
                                            _vllm_sampling(sampling, params, targets), arrival_time=arrival)
        try:
            await asyncio.wrap_future(engine.call(add))
        except Exception as exc:  # vLLM's own checks (say, a prompt its scheduler can never fit)
            streams.pop(request_id, None)
            counters.tracked.pop(request_id, None)
            raise BadRequest(f"vLLM refused the request: {exc}") from None
        response, last = web.StreamResponse(), None
        try:
            last = await write_frames(request, frames, response,
                                      on_last=lambda frame: trace_phases(frame, config.engine_id, config.role))
        finally:
            streams.pop(request_id, None)
            if last is None:  # the client went away: free the request's blocks now
                engine.call(lambda e: _abort(e, request_id, counters.tracked))
        return response

    for path, body_type, summary in GENERATION_ROUTES:
        service.route("POST", path, body=body_type, summary=summary)(generate)

    @service.route("POST", "/v1/abort", body=AbortRequest, response=Aborted)
    async def abort(request: web.Request, body: AbortRequest) -> Aborted:
        """Stop a request and free its blocks; its stream ends with finish_reason `abort`."""
        frames = await asyncio.wrap_future(engine.call(lambda e: _abort(e, body.request_id, counters.tracked)))
        dispatch(frames)
        return Aborted(aborted=bool(frames))

    @service.route("GET", "/v1/state", response=VllmEngineState)
    async def state(request: web.Request) -> VllmEngineState:
        """Free blocks of vLLM's pool, queue lengths, KV held for or pulled from other engines."""
        return counters.state

    @service.route("PUT", "/v1/policy", body=PolicyNames, response=PolicyNames)
    async def set_policy(request: web.Request, body: PolicyNames) -> PolicyNames:
        """Switch KVMeshScheduler's policies by name (policy_hooks.HOOKS), between two steps."""
        def switch(e) -> dict[str, str]:
            scheduler = _scheduler(e)
            scheduler.set_policies(body.policies)
            return dict(scheduler.policy_names)
        try:
            return PolicyNames(policies=await asyncio.wrap_future(engine.call(switch)))
        except KeyError as exc:
            raise BadRequest(str(exc.args[0])) from None

    @service.route("GET", "/v1/tokenizer", response=TokenizerSpec)
    async def tokenizer_route(request: web.Request) -> TokenizerSpec:
        """The model's tokenizer, chat template and context limit (admission tokenizes with it)."""
        return tokenizer_spec

    return service


def _tier_journal(table: HostTable, slot_bytes: int) -> CacheJournal:
    """The cxl tier's table as the cache publisher reads it."""
    return CacheJournal(take=table.take_changes, nodes=lambda: table.nodes.values(), note=table.note_changes,
                        entry=lambda n: CacheEntry(node_id=n.node_id, tier="cxl", size=slot_bytes, score=float(n.score)))


def _refuse_native_only(config: EngineConfig) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"backend vllm: {sys.executable} has no vLLM; run the engine with a Python that has it "
                          "(.venv-vllm/bin/python here, from scripts/setup-vllm.sh; kvmesh[vllm] on GPUs)")
    check_config(config)


def check_config(config: EngineConfig) -> None:
    """A ConfigError for settings an engine on vLLM cannot honour (what only the native engine has)."""
    others = sorted(set(config.policies) - set(HOOKS))
    if others:
        raise ConfigError(f"backend vllm: policies {', '.join(others)} are the native engine's; vLLM's takes "
                          f"{', '.join(HOOKS)} (docs/vllm.md)")
    native = [name for name, on in (("prefix_cache_sparsify", config.prefix_cache_sparsify),
                                    ("layer_staging_blocks", bool(config.layer_staging_blocks)),
                                    ("cxl_path", bool(config.cxl_path))) if on]
    if native:
        raise ConfigError(f"backend vllm: {', '.join(native)} are the native engine's (docs/vllm.md)")
    if config.prefix_cache_cxl and not config.prefix_caching:
        raise ConfigError("prefix_cache_cxl keeps prefix blocks vLLM's device cache lets go in the cxl tier: it "
                          "needs prefix_caching")
    if config.device == "cpu" and config.block_size % CPU_BLOCK_MULTIPLE:
        raise ConfigError(f"backend vllm: vLLM on the CPU needs block_size a multiple of {CPU_BLOCK_MULTIPLE}, "
                          f"got {config.block_size}")


def _vllm_environment(config: EngineConfig) -> None:
    """What vLLM reads from the environment, set before it is imported: its core in this process (the
    service steps it), no downloads, and the KV cache sized by device_bytes, not VLLM_CPU_KVCACHE_SPACE."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if config.torch_threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(config.torch_threads))


def _checkpoint(config: EngineConfig) -> tuple[Path, Path | None]:
    """The checkpoint directory vLLM loads, and a scratch directory to remove at exit: a preset's
    weights (random, from `seed`, the same on every engine) are written to one first."""
    source = resolve_model(config.model)
    if source.preset is None:
        return source.checkpoint, None
    scratch = Path(tempfile.mkdtemp(prefix=f"kvmesh-{config.model}-"))
    return save_preset_checkpoint(source.preset, scratch, seed=config.seed), scratch


def kv_context_limit(config: EngineConfig, geometry: Geometry, model_limit: int) -> int:
    """The longest request vLLM is told to take: max_model_len if set, else the model's own limit cut to
    what the KV cache (device_bytes) holds, in whole blocks. vLLM refuses to start when one request of
    its max_model_len does not fit; the native engine cuts its context the same way (factory.py)."""
    if config.max_model_len:
        return config.max_model_len
    token_bytes = BlockShape(1, geometry.num_kv_heads, geometry.head_dim, getattr(torch, config.dtype)).bytes \
        * geometry.num_layers
    fits = (config.device_bytes // token_bytes // config.block_size - 1) * config.block_size  # vLLM keeps a null block
    if fits < config.block_size:
        raise ConfigError(f"device_bytes {config.device_bytes} holds no block of this model's KV "
                          f"({token_bytes * config.block_size} bytes)")
    return min(model_limit, fits)


def cxl_tier_blocks(config: EngineConfig, geometry: Geometry) -> int:
    """The cxl tier's slots under prefix_cache_cxl: cxl_blocks, else as many blocks of every layer
    as cxl_bytes holds; 0 without it."""
    if not config.prefix_cache_cxl:
        return 0
    block_bytes = BlockShape(config.block_size, geometry.num_kv_heads, geometry.head_dim,
                             getattr(torch, config.dtype)).bytes * geometry.num_layers
    blocks = config.cxl_blocks or config.cxl_bytes // block_bytes
    if blocks <= 0:
        raise ConfigError(f"prefix_cache_cxl: cxl_bytes {config.cxl_bytes} holds no block of every layer "
                          f"({block_bytes} bytes)")
    return blocks


def _geometry(hf_config) -> Geometry:
    heads = hf_config.num_attention_heads
    return Geometry(num_layers=hf_config.num_hidden_layers,
                    num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                    head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                    vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size)


def _transfer_params(config: EngineConfig, body: GenerateRequest, ids: list[int], num_layers: int,
                     block_size: int) -> dict | None:
    """The connector's kv_transfer_params for a hand-off, or a 400 when this engine cannot do it."""
    if body.kv_transfer is not None:
        if config.role != "prefill" or config.dataplane == "none":
            raise BadRequest(f"kv_transfer: this engine ({config.role}, data plane {config.dataplane}) does not "
                             "hand off KV")
        if body.kv_transfer.mode != "pull":
            raise BadRequest("kv_transfer: the vLLM backend hands KV off in pull mode only")
        return {"do_remote_decode": True}
    if body.kv_source is not None:
        if config.role != "decode" or config.dataplane == "none":
            raise BadRequest(f"kv_source: this engine ({config.role}, data plane {config.dataplane}) does not pull KV")
        handle = body.kv_source
        handle.check(num_layers, block_size, len(ids) - 1)
        if handle.tiers is not None and set(handle.tiers) != {"device"}:
            raise BadRequest("kv_source: the vLLM backend pulls from a prefill engine's device tier only")
        return {"remote_engine_id": handle.engine, "remote_request_id": handle.request_id,
                "remote_address": handle.data_address, "remote_block_ids": list(handle.layers[0]),
                "num_tokens": handle.num_tokens}
    return None


def _vllm_sampling(sampling: SamplingParams, kv_transfer_params: dict | None, targets: dict):
    """vLLM's sampling parameters; the hand-off's kv_transfer_params and the request's SLOs and predicted
    lengths (for KVMeshScheduler) ride in extra_args."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, seed=sampling.seed, stop=list(sampling.stop),
                              stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
                              logprobs=0 if sampling.logprobs else None, output_kind=RequestOutputKind.DELTA,
                              extra_args={**({"kv_transfer_params": kv_transfer_params} if kv_transfer_params
                                                 else {}), TARGETS: targets})


def _frame(output, counters: Counters, config: EngineConfig, geometry: Geometry, block_size: int, engine) -> Frame:
    """A step's output for one request (vLLM's delta) as the native engine's frame; the last carries
    the timings the native engine's do (when it was scheduled, its pull), for its trace."""
    now = time.time()
    tracked = counters.tracked
    request = tracked[output.request_id]
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    if tokens and request.first_token is None:
        request.first_token = now
    request.completion_tokens += len(tokens)
    counters.generated_tokens += len(tokens)
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens)] \
        if request.logprobs and completion.logprobs else None
    frame = Frame(request_id=output.request_id, token_ids=tokens, text=completion.text, times=[now] * len(tokens),
                  logprobs=logprobs)
    if output.finished:
        del tracked[output.request_id]
        cached = output.num_cached_tokens or 0
        counters.cached_prompt_tokens += cached
        counters.computed_prompt_tokens += request.prompt_tokens - cached
        frame.finish_reason = completion.finish_reason or "stop"
        frame.usage = Usage(prompt_tokens=request.prompt_tokens, completion_tokens=request.completion_tokens,
                            cached_tokens=cached)
        frame.timings = _timings(engine, request, now, config.dataplane)
        params = output.kv_transfer_params
        if request.hands_off and params and params.get("remote_block_ids"):
            frame.kv_handle = KVHandle(engine=config.engine_id, data_address=params["remote_address"],
                                       request_id=params["remote_request_id"], num_tokens=params["num_tokens"],
                                       block_size=block_size, layers=[list(params["remote_block_ids"])] * geometry.num_layers)
    return frame


def _timings(engine, request: Tracked, finished: float, backend: str) -> Timings:
    timings = Timings(arrival=request.arrival, first_token=request.first_token, finished=finished,
                      scheduled=_scheduler(engine).scheduled_at.pop(request.vllm_id, None))
    connector = _worker_connector()
    pulled = connector.pull_of(request.vllm_id) if connector is not None else None
    if pulled is not None:
        load, report = pulled
        timings.pull_start, timings.pull_end = load.started, load.started + report.seconds
        timings.transfer = TransferStats(bytes=report.bytes, pieces=report.pieces, reads_posted=report.reads_posted,
                                         seconds=report.seconds, backend=backend, peer=load.address)
    return timings


def _abort(engine, request_id: str, tracked: dict[str, Tracked]) -> list[Frame]:
    """On the engine's thread: stop the request; its last frame, or none when it is not running here."""
    request = tracked.pop(request_id, None)
    if request is None:
        return []
    engine.abort_request([request_id])
    return [Frame(request_id=request_id, token_ids=[], text="", times=[], finish_reason="abort",
                  usage=Usage(prompt_tokens=request.prompt_tokens, completion_tokens=request.completion_tokens,
                              cached_tokens=0))]


def _observe(engine, counters: Counters) -> None:
    """On the engine's thread, between steps: the state `GET /v1/state` and the heartbeats report."""
    scheduler = _scheduler(engine)
    pool = scheduler.kv_cache_manager.block_pool
    connector = _worker_connector()
    table = scheduler.connector.table if scheduler.connector is not None else None
    tier = {}
    if table is not None:   # between steps no slot is pinned: every cached node is free to give up
        moved = {"cxl": table.saved, "device": table.loaded}
        tier = dict(prefix_cache_lookup_blocks={"cxl": table.looked_up}, prefix_cache_hit_blocks={"cxl": table.loaded},
                    prefix_cache_nodes={"cxl": len(table.nodes)}, prefix_cache_moved_nodes=moved,
                    prefix_cache_moved_bytes={t: n * connector.tier.slot_bytes for t, n in moved.items()})
    counters.state = VllmEngineState(
        backend="vllm", free_blocks={"device": pool.get_num_free_blocks(),
                                     **({"cxl": table.capacity} if table is not None else {})},
        total_blocks={"device": pool.num_gpu_blocks - 1,   # less vLLM's null block
                      **({"cxl": table.capacity} if table is not None else {})},
        waiting=len(scheduler.waiting), running=len(scheduler.running), swapped=0,
        pulling=connector.pulling if connector is not None else 0,
        held_kv=connector.held if connector is not None else 0, policies=dict(scheduler.policy_names),
        prefill_cost=scheduler.prefill_cost, prefills_held_back=scheduler.held_back,
        preemptions={"recompute": scheduler.preemptions}, recent_preemptions=list(scheduler.recent_preemptions),
        unallocated_tokens=scheduler.ledger.unallocated_tokens(), allocations_grown=dict(scheduler.ledger.grown),
        generated_tokens=counters.generated_tokens, computed_prompt_tokens=counters.computed_prompt_tokens,
        prefix_cache_hit_tokens=counters.cached_prompt_tokens,
        kv_transfer=copy.copy(connector.transferred) if connector is not None else TransferTotals(), **tier)


def _worker_connector():
    """The worker side of KVMeshConnector (one worker, in this process), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _scheduler(engine):
    """The engine's KVMeshScheduler (its core runs in this process)."""
    return engine.engine_core.engine_core.scheduler


def _load(state: VllmEngineState) -> Load:
    return Load(free_blocks=state.free_blocks, waiting=state.waiting, running=state.running, swapped=0)


def _tokenizer_spec(config: EngineConfig, model_dir: Path, tokenizer, context_limit: int) -> TokenizerSpec:
    from transformers import GenerationConfig

    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    with contextlib.suppress(OSError):
        configured = GenerationConfig.from_pretrained(model_dir).eos_token_id
        eos |= set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    special = {name: value for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if isinstance(value := getattr(tokenizer, name, None), str)}
    return TokenizerSpec(model=config.model, tokenizer_json=tokenizer.backend_tokenizer.to_str(),
                         chat_template=getattr(tokenizer, "chat_template", None), special_tokens=special,
                         eos_token_ids=sorted(eos), max_model_len=context_limit)
