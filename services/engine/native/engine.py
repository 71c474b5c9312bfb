"""The engine: schedule, run the model, sample, and turn the results into frames for clients.

`Engine.step()` is one iteration and touches engine state from one thread only; it returns what the
service is to act on (events.py) and calls nothing of the service's. `EngineLoop` (engine_loop.py)
builds the engine and runs it on its own thread (torch releases the GIL while it computes, so the
HTTP side stays responsive). The KV hand-off's calls between steps are in engine_handoff.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from kvmesh.libs.messages.engine import Frame, KVHandle, SamplingParams, Targets, Timings, Usage
from kvmesh.policies.step_shape import Shape, step_shape

from ..state import EngineState, LayerProfile, SparsityProfile, SwapProfile, TransferTotals
from .block_manager import BlockManager
from .detokenizer import advance_text
from .engine_handoff import EngineHandoff
from .events import EngineEvents
from .model_runner import ModelRunner
from .request import KVPushTarget, Request, Status
from .sampling import sample
from .scheduler import Scheduler


@dataclass
class Engine(EngineHandoff):
    runner: ModelRunner
    blocks: BlockManager
    scheduler: Scheduler
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    clock: Callable[[], float] = time.time
    steps: int = 0
    last_shape: Shape | None = None  # the last step's (policies.step_shape), before its chunks were computed
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    generated_tokens: int = 0
    computed_prompt_tokens: int = 0
    transferred: TransferTotals = field(default_factory=TransferTotals)
    swap_profile: SwapProfile | None = None
    layer_profile: LayerProfile | None = None
    sparsity_profile: SparsityProfile | None = None
    # The KV hand-off (docs/serving.md): who we are on the data plane, how long held KV waits for its
    # decode engine.
    engine_id: str = "engine-0"
    data_address: str = ""
    kv_lease_s: float = 30.0
    # LayerKV: the output length assumed of a request no predictor gave a range for (None: nothing assumed).
    output_len_fallback: int | None = None
    held: dict[str, tuple[Request, float]] = field(default_factory=dict)  # request id -> (request, deadline)
    # Push mode: sampled, blocks kept until the writes land; request id -> (request, its text; None: aborted)
    pushing: dict[str, tuple[Request, str | None]] = field(default_factory=dict)
    last_pushed_bytes: int = 0  # the KV bytes the last step wrote to decode engines (push mode)
    _aborted_pulls: dict[str, Request] = field(default_factory=dict)     # their blocks free when the pull ends
    _tbt: deque[float] = field(default_factory=lambda: deque(maxlen=512))

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *, hold_kv: bool = False,
            push: KVPushTarget | None = None, kv_source: KVHandle | None = None, arrival: float | None = None,
            targets: Targets = Targets()) -> Request:
        """Queue a request; `arrival` (default now) is when it reached the engine, so the wait for
        the engine thread to take it counts as queueing."""
        if self.output_len_fallback and targets.predicted_output_low is None:
            assumed = min(self.output_len_fallback, sampling.max_tokens)
            targets = msgspec.structs.replace(targets, predicted_output_low=assumed,
                                              predicted_output_median=targets.predicted_output_median or assumed)
        request = Request(request_id, list(prompt_ids), sampling, arrival or self.clock(), self.blocks.num_layers,
                          hold_kv=hold_kv, push=push, kv_source=kv_source, targets=targets)
        self._seed(request)
        self.scheduler.add(request)
        return request

    def _seed(self, request: Request) -> None:
        if request.sampling.seed is not None:
            request.generator = torch.Generator(device=self.runner.device).manual_seed(request.sampling.seed)

    def abort(self, request_id: str, reason: str = "abort") -> list[Frame]:
        """End a request wherever it is and free its blocks; its last frame, or none if it is unknown.
        A request whose KV is being pulled keeps its blocks until the pull has ended (`pull_done`), one
        whose KV is being pushed until its writes have landed (`pushes_landed`)."""
        request = self.scheduler.find(request_id)
        if request is None:
            return self._abort_pushing(request_id, reason)
        pulling = request.status is Status.PULLING and not request.reservation
        self.scheduler.finish(request, reason, release=not pulling and request.push is None)
        if pulling:
            self._aborted_pulls[request_id] = request
        if request.push is not None:  # writes may be in flight: its blocks are freed once they have landed
            self.pushing[request_id] = (request, None)
            request.push.finish()
        return [self._frame(request, [], [], [], "")]

    @property
    def last_staged_bytes(self) -> int:
        """The KV bytes the last step copied through its staging area (LayerKV; 0 without one)."""
        return 0 if self.runner.staging is None else self.runner.staging.staged_bytes

    def step(self) -> EngineEvents:
        now = self.clock()
        plan = self.scheduler.schedule(now)
        self.last_shape = step_shape((len(c.request.prompt_ids), c.request.num_computed, c.num_tokens)
                                     for c in plan.chunks)
        for victim, strategy in plan.preempted:
            self.preemptions[strategy] += 1
            # Its blocks may be reused while writes read them: once resumed, it writes its prompt again.
            victim.push_from = 0
        events = EngineEvents(pulls=[self._pull_order(request, now) for request in plan.pulls])
        if not plan.chunks:
            self.blocks.flush_loads()
            return events
        sampling = [c for c in plan.chunks if c.samples]
        # Push mode: each prompt chunk's blocks are written out, each layer's as the layer is done.
        writes = self._push_writes(plan.chunks)
        try:
            logits = self.runner.run(plan.chunks, self.blocks.layer_loads(), plan.staging,
                                     after_layer=self._pusher(writes) if writes else None)
        finally:
            self.blocks.loads_done()
            self.blocks.give_back([*plan.staging[0], *plan.staging[1]])
        tokens, logprobs = sample(logits, [c.request.sampling for c in sampling],
                                  [c.request.generator for c in sampling]) if sampling else ([], [])
        done = self.clock()
        for chunk in plan.chunks:
            prompt_left = len(chunk.request.prompt_ids) - chunk.request.num_computed
            self.computed_prompt_tokens += max(0, min(chunk.num_tokens, prompt_left))
            chunk.request.num_computed += chunk.num_tokens
            self.blocks.commit(chunk.request, done)
        self.steps += 1
        for chunk, token, logprob in zip(sampling, tokens, logprobs):
            frame = self._emit(chunk.request, token, logprob, done)
            if chunk.request.push is None:
                events.frames.append(frame)
            else:  # its first token goes out when its writes have landed (pushes_landed)
                self._await_writes(chunk.request, frame.text)
        self.blocks.offload_idle()  # CaR: idle prefix nodes out to the cxl tier past the high-water mark
        # The whole step, the work after its sample too: what a running request waits a token (CaR's
        # TPOP, weighed against the time it has run on this clock), and what a simulated step lasts.
        self.scheduler.iteration_s.append(self.clock() - now)
        return events

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
        elif reason is not None:  # push mode keeps the blocks until the writes have landed
            self.scheduler.finish(request, reason, release=request.push is None)
        frame = self._frame(request, [token], [now], [logprob], text)
        if handle is not None:
            frame.kv_handle = handle
        return frame

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
        return EngineState(free_blocks=dict(view.free), total_blocks=dict(view.total), block_size=view.block_size,
                           max_num_seqs=self.scheduler.max_num_seqs, token_budget=self.scheduler.token_budget,
                           waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
                           swapped=len(self.scheduler.swapped), pulling=len(self.scheduler.pulling),
                           held_kv=len(self.held), pushing=len(self.pushing),
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


