"""vLLM's step outputs as the engine service's frames, and its scheduler and connector as the engine's
state, on the engine's thread: what makes the vLLM backend's requests and `GET /v1/state` look as
the native engine's do."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from kvmesh.libs.kvmeta.messages import CacheEntry
from kvmesh.libs.messages.engine import Frame, KVHandle, Timings, TransferStats, Usage

from ..cache_publisher import CacheJournal
from ..config import EngineConfig
from ..state import EngineState, TransferTotals
from .host_table import HostTable
from .settings import Geometry


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
class Counters:
    """Kept on the engine's thread; `state` is replaced whole after each step, read by HTTP and scrapes."""

    state: EngineState | None = None
    generated_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    tracked: dict[str, Tracked] = field(default_factory=dict)


def frame_of(output, counters: Counters, config: EngineConfig, geometry: Geometry, block_size: int, engine) -> Frame:
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
        frame.timings = timings_of(engine, request, now, config.dataplane)
        params = output.kv_transfer_params
        if request.hands_off and params and params.get("remote_block_ids"):
            frame.kv_handle = KVHandle(engine=config.engine_id, data_address=params["remote_address"],
                                       request_id=params["remote_request_id"], num_tokens=params["num_tokens"],
                                       block_size=block_size, layers=[list(params["remote_block_ids"])] * geometry.num_layers)
    return frame


def timings_of(engine, request: Tracked, finished: float, backend: str) -> Timings:
    timings = Timings(arrival=request.arrival, first_token=request.first_token, finished=finished,
                      scheduled=scheduler_of(engine).scheduled_at.pop(request.vllm_id, None))
    connector = worker_connector()
    pulled = connector.pull_of(request.vllm_id) if connector is not None else None
    if pulled is not None:
        load, report = pulled
        timings.pull_start, timings.pull_end = load.started, load.started + report.seconds
        timings.transfer = TransferStats(bytes=report.bytes, pieces=report.pieces, reads_posted=report.reads_posted,
                                         seconds=report.seconds, backend=backend, peer=load.address)
    return timings


def abort_request(engine, request_id: str, tracked: dict[str, Tracked]) -> list[Frame]:
    """On the engine's thread: stop the request; its last frame, or none when it is not running here."""
    request = tracked.pop(request_id, None)
    if request is None:
        return []
    engine.abort_request([request_id])
    return [Frame(request_id=request_id, token_ids=[], text="", times=[], finish_reason="abort",
                  usage=Usage(prompt_tokens=request.prompt_tokens, completion_tokens=request.completion_tokens,
                              cached_tokens=0))]


def observe(engine, counters: Counters) -> None:
    """On the engine's thread, between steps: the state `GET /v1/state` and the heartbeats report."""
    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    connector = worker_connector()
    table = scheduler.connector.table if scheduler.connector is not None else None
    tier = {}
    if table is not None:   # between steps no slot is pinned: every cached node is free to give up
        moved = {"cxl": table.saved, "device": table.loaded}
        tier = dict(prefix_cache_lookup_blocks={"cxl": table.looked_up}, prefix_cache_hit_blocks={"cxl": table.loaded},
                    prefix_cache_nodes={"cxl": len(table.nodes)}, prefix_cache_moved_nodes=moved,
                    prefix_cache_moved_bytes={t: n * connector.tier.slot_bytes for t, n in moved.items()})
    counters.state = EngineState(
        backend="vllm", free_blocks={"device": pool.get_num_free_blocks(),
                                     **({"cxl": table.capacity} if table is not None else {})},
        total_blocks={"device": pool.num_gpu_blocks - 1,   # less vLLM's null block
                      **({"cxl": table.capacity} if table is not None else {})},
        block_size=scheduler.block_size, max_num_seqs=scheduler.max_num_active_reqs,
        token_budget=scheduler.max_num_scheduled_tokens,
        waiting=len(scheduler.waiting), running=len(scheduler.running), swapped=0,
        pulling=connector.pulling if connector is not None else 0,
        held_kv=connector.held if connector is not None else 0, policies=dict(scheduler.policy_names),
        prefill_cost=scheduler.prefill_cost, prefills_held_back=scheduler.held_back,
        preemptions={"recompute": scheduler.preemptions}, recent_preemptions=list(scheduler.recent_preemptions),
        unallocated_tokens=scheduler.ledger.unallocated_tokens(), allocations_grown=dict(scheduler.ledger.grown),
        generated_tokens=counters.generated_tokens, computed_prompt_tokens=counters.computed_prompt_tokens,
        prefix_cache_hit_tokens=counters.cached_prompt_tokens,
        kv_transfer=copy.copy(connector.transferred) if connector is not None else TransferTotals(), **tier)


def worker_connector():
    """The worker side of KVMeshConnector (one worker, in this process), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def scheduler_of(engine):
    """The engine's KVMeshScheduler (its core runs in this process)."""
    return engine.engine_core.engine_core.scheduler


def tier_journal(table: HostTable, slot_bytes: int) -> CacheJournal:
    """The cxl tier's table as the cache publisher reads it."""
    return CacheJournal(take=table.take_changes, nodes=lambda: table.nodes.values(), note=table.note_changes,
                        entry=lambda n: CacheEntry(node_id=n.node_id, tier="cxl", size=slot_bytes, score=float(n.score)))
