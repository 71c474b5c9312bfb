"""The engine: schedule, run the model, sample, and turn the results into frames for clients.

`Engine.step()` is one iteration and touches engine state from one thread only; `EngineLoop` builds
the engine and runs it on its own thread (torch releases the GIL while it computes, so the HTTP side
stays responsive) and takes new requests and aborts through a queue.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import torch

from ..handoff import KVHandle, KVPushTarget, TransferStats
from ..wire import EngineState, Frame, LayerProfile, SamplingParams, SparsityProfile, SwapProfile, Targets, TransferTotals, Timings, Usage
from .block_manager import BlockManager
from .detokenizer import advance_text
from .model_runner import ModelRunner
from .request import Request, Status
from .sampling import sample
from .scheduler import Scheduler

log = logging.getLogger(__name__)

T = TypeVar("T")

STATE_EVERY_S = 0.05  # how stale GET /v1/state, /metrics and the heartbeat load may be while the engine is busy


@dataclass
class Engine:
    runner: ModelRunner
    blocks: BlockManager
    scheduler: Scheduler
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    clock: Callable[[], float] = time.time
    steps: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    generated_tokens: int = 0
    computed_prompt_tokens: int = 0
    transferred: TransferTotals = field(default_factory=TransferTotals)
    swap_profile: SwapProfile | None = None
    layer_profile: LayerProfile | None = None
    sparsity_profile: SparsityProfile | None = None
    # The KV hand-off (docs/serving.md): who we are on the data plane, how long held KV waits for its
    # decode engine, and the service's hooks for starting a pull and for KV given up.
    engine_id: str = "engine-0"
    data_address: str = ""
    kv_lease_s: float = 30.0
    # LayerKV: the output length assumed of a request no predictor gave a range for (None: nothing assumed).
    output_len_fallback: int | None = None
    on_pull: Callable[[Request], None] = lambda request: None
    on_kv_released: Callable[[str], None] = lambda request_id: None
    held: dict[str, tuple[Request, float]] = field(default_factory=dict)  # request id -> (request, deadline)
    _aborted_pulls: dict[str, Request] = field(default_factory=dict)     # their blocks free when the pull ends
    _tbt: deque[float] = field(default_factory=lambda: deque(maxlen=512))

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *, hold_kv: bool = False,
            push: KVPushTarget | None = None, kv_source: KVHandle | None = None, arrival: float | None = None,
            targets: Targets = Targets()) -> Request:
        """Queue a request; `arrival` (default now) is when it reached the engine, so the wait for
        the engine thread to take it counts as queueing."""
        if self.output_len_fallback and targets.predicted_output_low is None:
            assumed = min(self.output_len_fallback, sampling.max_tokens)
            targets = dataclasses.replace(targets, predicted_output_low=assumed,
                                          predicted_output_median=targets.predicted_output_median or assumed)
        request = Request(request_id, list(prompt_ids), sampling, arrival or self.clock(), self.blocks.num_layers,
                          hold_kv=hold_kv, push=push, kv_source=kv_source, targets=targets)
        self._seed(request)
        self.scheduler.add(request)
        return request

    def reserve(self, request_id: str, num_tokens: int) -> Request:
        """Push mode, decode role: queue a reservation of blocks for `num_tokens` tokens of KV; the
        scheduler gives them when its allocation policy will (then `on_pull` tells the service)."""
        placeholder = [0] * (num_tokens + 1)  # the real tokens come with the request that claims it
        request = Request(request_id, placeholder, SamplingParams(max_tokens=1), self.clock(), self.blocks.num_layers,
                          reservation=True)
        self.scheduler.add(request)
        return request

    def claim(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
              arrival: float | None = None, targets: Targets = Targets()) -> bool:
        """Push mode: the request whose KV a prefill engine wrote into reserved blocks decodes on."""
        request = next((r for r in self.scheduler.pulling if r.request_id == request_id and r.reservation), None)
        if request is None or len(prompt_ids) != request.num_tokens:
            return False
        request.prompt_ids, request.sampling, request.arrival = list(prompt_ids), sampling, arrival or self.clock()
        request.targets = targets
        request.pull_times = (request.scheduled_at, request.arrival)
        self._seed(request)
        self.scheduler.pulled(request, request.arrival)
        return True

    def _seed(self, request: Request) -> None:
        if request.sampling.seed is not None:
            request.generator = torch.Generator(device=self.runner.device).manual_seed(request.sampling.seed)

    def abort(self, request_id: str, reason: str = "abort") -> list[Frame]:
        """End a request wherever it is and free its blocks; its last frame, or none if it is unknown.
        A request whose KV is being pulled keeps its blocks until the pull has ended (`pull_done`)."""
        request = self.scheduler.find(request_id)
        if request is None:
            return []
        pulling = request.status is Status.PULLING and not request.reservation
        self.scheduler.finish(request, reason, release=not pulling)
        if pulling:
            self._aborted_pulls[request_id] = request
        return [self._frame(request, [], [], [], "")]

    def pull_done(self, request_id: str, started: float, error: str | None = None,
                  transfer: TransferStats | None = None) -> list[Frame]:
        """A pull has ended: the request decodes on, or (failed, or aborted meanwhile) it is freed."""
        if transfer is not None:
            self.transferred.add(transfer)
        aborted = self._aborted_pulls.pop(request_id, None)
        if aborted is not None:  # aborted while pulling: its blocks were kept until now
            self.blocks.release(aborted)
            return []
        request = next((r for r in self.scheduler.pulling if r.request_id == request_id), None)
        if request is None:
            return []
        request.pull_times, request.transfer = (started, self.clock()), transfer
        if error is None:
            self.scheduler.pulled(request, self.clock())
            return []
        log.warning("pulling the KV of %s failed: %s", request_id, error)
        self.scheduler.finish(request, "error")
        return [self._frame(request, [], [], [], "")]

    def release_held(self, request_id: str) -> bool:
        """Free the KV held for a decode engine (its COMPLETE, an abort, or the lease running out)."""
        entry = self.held.pop(request_id, None)
        if entry is None:
            return False
        self.blocks.release(entry[0])
        self.on_kv_released(request_id)
        return True

    def expire_leases(self, now: float) -> float | None:
        """Free held KV and reservations whose lease ran out; the seconds until the next deadline."""
        for request_id in [r for r, (_, deadline) in self.held.items() if deadline <= now]:
            log.warning("no decode engine pulled the KV of %s within its lease: freed", request_id)
            self.release_held(request_id)
        reserved = [r for r in self.scheduler.pulling if r.reservation and r.kv_deadline is not None]
        for request in [r for r in reserved if r.kv_deadline <= now]:
            log.warning("nobody claimed the blocks reserved for %s within their lease: freed", request.request_id)
            self.abort(request.request_id, "abort")
        deadlines = [d for _, d in self.held.values()] + [r.kv_deadline for r in reserved if r.kv_deadline > now]
        return min(deadlines) - now if deadlines else None

    def step(self) -> list[Frame]:
        now = self.clock()
        plan = self.scheduler.schedule(now)
        for _victim, strategy in plan.preempted:
            self.preemptions[strategy] += 1
        for request in plan.pulls:
            if request.reservation:
                request.kv_deadline = now + self.kv_lease_s
            self.on_pull(request)
        if not plan.chunks:
            self.blocks.flush_loads()
            return []
        sampling = [c for c in plan.chunks if c.samples]
        # Push mode: prompts that finish in this step write each layer's KV out as the layer is done.
        pushing = [c.request for c in sampling if c.request.push is not None]
        self.runner.model.after_layer = self._pusher(pushing) if pushing else None
        try:
            logits = self.runner.run(plan.chunks, self.blocks.layer_loads(), plan.staging)
        finally:
            self.runner.model.after_layer = None
            self.blocks.loads_done()
            self.blocks.give_back([*plan.staging[0], *plan.staging[1]])
        failed = {r.request_id: error for r in pushing if (error := r.push.wait()) is not None}
        tokens, logprobs = sample(logits, [c.request.sampling for c in sampling],
                                  [c.request.generator for c in sampling]) if sampling else ([], [])
        done = self.clock()
        self.scheduler.iteration_s.append(done - now)
        for chunk in plan.chunks:
            prompt_left = len(chunk.request.prompt_ids) - chunk.request.num_computed
            self.computed_prompt_tokens += max(0, min(chunk.num_tokens, prompt_left))
            chunk.request.num_computed += chunk.num_tokens
            self.blocks.commit(chunk.request, done)
        self.steps += 1
        frames = []
        for chunk, token, logprob in zip(sampling, tokens, logprobs):
            request = chunk.request
            if request.request_id in failed:
                log.warning("pushing the KV of %s failed: %s", request.request_id, failed[request.request_id])
                self.scheduler.finish(request, "error")
                frames.append(self._frame(request, [], [], [], ""))
                continue
            frames.append(self._emit(request, token, logprob, done))
        self.blocks.offload_idle()  # CaR: idle prefix nodes out to the cxl tier past the high-water mark
        return frames

    def _pusher(self, requests: list[Request]) -> Callable[[int], None]:
        def layer_done(layer: int) -> None:
            for request in requests:
                kv_blocks = -(-len(request.prompt_ids) // self.blocks.block_size)
                request.push.layer_done(layer, request.layers[layer].blocks[:kv_blocks])
        return layer_done

    def _emit(self, request: Request, token: int, logprob: float, now: float) -> Frame:
        if request.output_times:
            self._tbt.append(now - request.output_times[-1])
        self.generated_tokens += 1
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        request.output_times.append(now)
        params = request.sampling
        reason = None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif len(request.output_ids) >= params.max_tokens:
            reason = "length"
        text, stopped = advance_text(request, self.tokenizer, final=reason is not None)
        if stopped:
            reason = "stop"
        handle = None
        if reason == "length" and request.hold_kv:  # the decode engine takes it from here
            self.scheduler.finish(request, reason, release=False)
            self.held[request.request_id] = (request, now + self.kv_lease_s)
            handle = self._handle(request)
        elif reason is not None:
            self.scheduler.finish(request, reason)
        frame = self._frame(request, [token], [now], [logprob], text)
        if handle is not None:
            frame.kv_handle = handle
        return frame

    def _handle(self, request: Request) -> KVHandle:
        kv_tokens = request.num_tokens - 1  # the sampled token's KV is the decode engine's first step
        per_layer = -(-kv_tokens // self.blocks.block_size)
        return KVHandle(engine=self.engine_id, data_address=self.data_address, request_id=request.request_id,
                        num_tokens=kv_tokens, block_size=self.blocks.block_size,
                        layers=[layer.blocks[:per_layer] for layer in request.layers],
                        tiers=[layer.tier for layer in request.layers] if request.offloaded else None)

    def _frame(self, request: Request, tokens: list[int], times: list[float], logprobs: list[float],
               text: str) -> Frame:
        usage = timings = None
        if request.finished:
            usage = Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.output_ids),
                          cached_tokens=request.num_cached)
            pull = request.pull_times or (None, None)
            timings = Timings(arrival=request.arrival, scheduled=request.scheduled_at, pull_start=pull[0],
                              pull_end=pull[1], first_token=request.output_times[0] if request.output_times else None,
                              finished=self.clock(), transfer=request.transfer)
        return Frame(request_id=request.request_id, token_ids=tokens, text=text, times=times,
                     logprobs=logprobs if request.sampling.logprobs else None,
                     finish_reason=request.finish_reason, usage=usage, timings=timings)

    def state(self) -> EngineState:
        view = self.blocks.pool_view()
        tbt = sorted(self._tbt)
        return EngineState(free_blocks=dict(view.free), total_blocks=dict(view.total),
                           waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
                           swapped=len(self.scheduler.swapped), pulling=len(self.scheduler.pulling),
                           held_kv=len(self.held),
                           tbt_ms_p50=tbt[len(tbt) // 2] * 1e3 if tbt else None,
                           tbt_ms_p99=tbt[min(len(tbt) - 1, int(len(tbt) * 0.99))] * 1e3 if tbt else None,
                           steps=self.steps, preemptions=dict(self.preemptions),
                           prefix_cache_hit_tokens=self.blocks.hit_tokens,
                           unallocated_tokens=self.scheduler.ledger.unallocated_tokens(),
                           allocations_grown=dict(self.scheduler.ledger.grown),
                           layers_offloaded=dict(self.scheduler.layers_offloaded),
                           policies=dict(self.scheduler.policies.names),
                           generated_tokens=self.generated_tokens, computed_prompt_tokens=self.computed_prompt_tokens,
                           prefix_cache_lookup_blocks={t: self.blocks.lookup_blocks for t in self.blocks.cache_tiers},
                           prefix_cache_hit_blocks={t: self.blocks.hit_blocks[t] for t in self.blocks.cache_tiers},
                           prefix_cache_nodes=self.blocks.cached_nodes(),
                           prefix_cache_moved_nodes={t: self.blocks.moved_nodes[t] for t in self.blocks.cache_tiers},
                           prefix_cache_moved_bytes={t: self.blocks.moved_bytes[t] for t in self.blocks.cache_tiers},
                           kv_transfer=msgspec.structs.replace(self.transferred), swap_profile=self.swap_profile,
                           layer_profile=self.layer_profile, sparsity_profile=self.sparsity_profile)


class EngineLoop:
    """Builds the engine and runs `Engine.step()` on one thread of its own; new requests, aborts and
    policy changes come in through a queue and are applied between steps.

    Building on the stepping thread keeps one OpenMP team in the process. Loading the weights runs
    torch's parallel kernels, and the team of the thread that ran them lives as long as that thread.
    libgomp counts the threads of every team, and once they outnumber the CPUs it spins only 100
    times before it sleeps: a team left on the main thread made the step's worker thread sleep and be
    woken through a futex at every parallel region, 600-900 times a second under load."""

    def __init__(self, build: Callable[[], Engine], deliver: Callable[[list[Frame]], None]):
        self.deliver = deliver
        self.engine: Engine | None = None
        self.state: EngineState | None = None
        self._build = build
        self._built: Future[Engine] = Future()
        self._commands: queue.SimpleQueue[Callable[[], list[Frame]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self, timeout_s: float = 600.0) -> Engine:
        """Build the engine on the loop's thread and start stepping it; raises what building raised."""
        self._thread.start()
        return self._built.result(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def submit(self, command: Callable[[], list[Frame] | None]) -> None:
        """Run `command` on the engine thread between steps; the frames it returns are delivered."""
        self._commands.put(command)
        self._wake.set()

    def call(self, fn: Callable[[], tuple[T, list[Frame]]]) -> Future[T]:
        """Like submit, for a command with a result: `fn` returns (result, frames to deliver)."""
        future: Future[T] = Future()

        def command() -> list[Frame]:
            try:
                result, frames = fn()
            except Exception as exc:
                future.set_exception(exc)
                return []
            future.set_result(result)
            return frames

        self.submit(command)
        return future

    def _run(self) -> None:
        try:
            self.engine = self._build()
            self.state = self.engine.state()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self._built.set_exception(exc)
            return
        self._built.set_result(self.engine)
        published = 0.0
        while not self._stop.is_set():
            frames = self._drain()
            if self.engine.scheduler.has_work():
                try:
                    frames += self.engine.step()
                except Exception:
                    log.exception("engine step failed; failing the requests it held")
                    frames += self._fail_all()
            next_lease = self.engine.expire_leases(self.engine.clock())
            idle = not self.engine.scheduler.has_work()
            if idle or time.monotonic() - published > STATE_EVERY_S:  # not every step: it is the hot loop
                self.state, published = self.engine.state(), time.monotonic()
            if frames:
                self.deliver(frames)
            if idle:
                # A command submitted meanwhile has set it: the next drain takes it. Held KV is
                # checked again when its lease runs out.
                self._wake.wait(next_lease)
                self._wake.clear()

    def _drain(self) -> list[Frame]:
        frames: list[Frame] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return frames
            try:
                frames += command() or []
            except Exception:
                log.exception("engine command failed")

    def _fail_all(self) -> list[Frame]:
        scheduler = self.engine.scheduler
        requests = [*scheduler.running, *scheduler.waiting, *scheduler.swapped, *scheduler.pulling]
        return [frame for r in requests for frame in self.engine.abort(r.request_id, "error")]
