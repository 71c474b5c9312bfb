"""The native engine's side of the KV hand-off (docs/serving.md), run between steps: blocks reserved
for KV a prefill engine pushes and the request that claims them, pulls that end, KV held for a decode
engine under a lease and the handle that says where it is, and push mode's writes: each prompt
chunk's blocks, a layer at a time as the step computes them, and the first token held until they land.
`Engine` (engine.py) keeps the state these read: `held`, `pushing`, `_aborted_pulls` and `kv_lease_s`.
What the service is to do about them (pull, unlease) goes out as events (events.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvmesh.libs.messages.engine import Frame, KVHandle, SamplingParams, Targets, TransferStats
from kvmesh.policies.iteration import ScheduledChunk

from .events import EngineEvents, PullOrder
from .request import Request

log = logging.getLogger(__name__)


class EngineHandoff:
    """Engine's hand-off methods (a part of Engine, not used alone)."""

    def reserve(self, request_id: str, num_tokens: int) -> Request:
        """Push mode, decode role: queue a reservation of blocks for `num_tokens` tokens of KV; the
        scheduler gives them when its allocation policy will (then a step's PullOrder tells the service)."""
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

    def release_held(self, request_id: str) -> EngineEvents:
        """Free the KV held for a decode engine (its COMPLETE, an abort, or the lease running out);
        no event if none was held."""
        entry = self.held.pop(request_id, None)
        if entry is None:
            return EngineEvents()
        self.blocks.release(entry[0])
        return EngineEvents(released=[request_id])

    def expire_leases(self, now: float) -> tuple[EngineEvents, float | None]:
        """Free held KV and reservations whose lease ran out; the seconds until the next deadline."""
        events = EngineEvents()
        for request_id in [r for r, (_, deadline) in self.held.items() if deadline <= now]:
            log.warning("no decode engine pulled the KV of %s within its lease: freed", request_id)
            events += self.release_held(request_id)
        reserved = [r for r in self.scheduler.pulling if r.reservation and r.kv_deadline is not None]
        for request in [r for r in reserved if r.kv_deadline <= now]:
            log.warning("nobody claimed the blocks reserved for %s within their lease: freed", request.request_id)
            self.abort(request.request_id, "abort")
        deadlines = [d for _, d in self.held.values()] + [r.kv_deadline for r in reserved if r.kv_deadline > now]
        return events, min(deadlines) - now if deadlines else None

    def _pull_order(self, request: Request, now: float) -> PullOrder:
        """The scheduler gave `request` blocks for its KV: where they are, snapshotted on this thread."""
        if request.reservation:
            request.kv_deadline = now + self.kv_lease_s
        per_layer = -(-(request.num_tokens - 1) // self.blocks.block_size)
        return PullOrder(request.request_id, None if request.reservation else request.kv_source,
                         [list(layer.blocks[:per_layer]) for layer in request.layers])

    def _push_writes(self, chunks: list[ScheduledChunk]) -> list[tuple[Request, int, int]]:
        """Push mode: the blocks each prompt chunk of the step fills, (request, first, end) of its block
        lists, and the bytes they make in the step's record. Writes start where the last chunk's ended
        (`push_from`): a block a chunk completes is written again (an earlier chunk wrote its first part);
        the prefix cache's blocks go with the first chunk computed, and everything again after a preemption."""
        size, writes = self.blocks.block_size, []
        for chunk in chunks:
            request = chunk.request
            prompt = len(request.prompt_ids)
            if request.push is None or request.num_computed >= prompt:
                continue
            computed = min(request.num_computed + chunk.num_tokens, prompt)
            writes.append((request, request.push_from, -(-computed // size)))
            request.push_from = computed // size
        self.last_pushed_bytes = (sum(end - first for _, first, end in writes) * self.blocks.num_layers
                                  * self.blocks.device.shape.bytes)
        return writes

    def _pusher(self, writes: list[tuple[Request, int, int]]) -> Callable[[int], None]:
        def layer_done(layer: int) -> None:
            for request, first, end in writes:
                request.push.layer_done(layer, first, request.layers[layer].blocks[first:end])
        return layer_done

    def _await_writes(self, request: Request, text: str) -> None:
        """Push mode: the request has sampled its token (and left the scheduler, its blocks kept); its
        frame waits for the writes to land (`pushes_landed`) while the engine steps on."""
        self.pushing[request.request_id] = (request, text)
        request.push.finish()

    def pushes_landed(self) -> list[Frame]:
        """The requests whose writes have all landed, or failed: blocks freed, and the first token out
        (stamped now: the decode engine can take the KV from here), or an error."""
        frames = []
        for request_id in [r for r, (request, _) in self.pushing.items() if request.push.landed.done()]:
            request, text = self.pushing.pop(request_id)
            self.blocks.release(request)
            error = request.push.landed.result()
            if text is None:  # aborted: its last frame went out then
                continue
            if error is not None:
                log.warning("pushing the KV of %s failed: %s", request_id, error)
                request.finish_reason = "error"
                frames.append(self._frame(request, [], [], [], ""))
                continue
            now = self.clock()
            request.output_times[-1] = now
            frames.append(self._frame(request, request.output_ids[-1:], [now], request.output_logprobs[-1:], text))
        return frames

    def _abort_pushing(self, request_id: str, reason: str) -> list[Frame]:
        """Abort a request whose writes are landing: its blocks are freed once they have, with no frame."""
        entry = self.pushing.get(request_id)
        if entry is None or entry[1] is None:
            return []
        request = entry[0]
        self.pushing[request_id] = (request, None)
        request.finish_reason = reason
        return [self._frame(request, [], [], [], "")]

    def _handle(self, request: Request) -> KVHandle:
        kv_tokens = request.num_tokens - 1  # the sampled token's KV is the decode engine's first step
        per_layer = -(-kv_tokens // self.blocks.block_size)
        return KVHandle(engine=self.engine_id, data_address=self.data_address, request_id=request.request_id,
                        num_tokens=kv_tokens, block_size=self.blocks.block_size,
                        layers=[layer.blocks[:per_layer] for layer in request.layers],
                        tiers=[layer.tier for layer in request.layers] if request.offloaded else None)
