"""A simulated colocated engine: continuous batching with chunked prefill, in the native scheduler's
order (services/engine/native/scheduler.py): running requests first, preempting by the policy when
blocks run short, then waiting ones in the admission policy's order until the token budget, the
sequence limit or the blocks say stop. Every decision is a policies/ function, called with the
views the engine builds; blocks are a counter, one pool (the device tier), no prefix cache.

For disaggregation (sim/cluster.py moves the KV): a request with `hold_kv` keeps its blocks when it
ends, until `release_held`; one with `kv_elsewhere` is given blocks for that KV when admitted,
without computing it, and waits in `pulling` until `pulled`, as the native scheduler's decode role does."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvmesh.policies import registry
from kvmesh.policies.views import PoolView, blocks_for

from .request import SimRequest
from .step_cost import StepCost

# preemption_strategy chooses between recompute and a swap to the cxl tier: no tiers are simulated yet,
# and without one the native engine recomputes whatever the strategy says.
HOOKS = ("prefill_admission", "kv_allocation", "preemption_order")
# Allocation ahead (every kv_allocation but vLLM's) needs the step the native scheduler runs around
# policies/allocation/ledger.py: not simulated yet (docs/sim.md). vLLM's is never called: the native
# scheduler, too, calls the hook only when it allots ahead, and offers every waiting request a place in
# admission order.
ALLOCATIONS = ("block_at_a_time",)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    block_size: int = 16
    num_layers: int = 1
    device_blocks: int = 4096     # the device tier's blocks, all layers together
    max_num_seqs: int = 64
    token_budget: int = 2048      # tokens computed per step (chunked prefill)


@dataclass
class Step:
    chunks: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, tokens its KV computes)
    pulls: list[SimRequest] = field(default_factory=list)               # given blocks: their KV to pull now
    preempted: list[tuple[str, str]] = field(default_factory=list)      # (request id, strategy carried out)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_context: int = 0
    prefill_context: int = 0

    def add(self, request: SimRequest, n: int) -> None:
        self.chunks.append((request, n))
        prefill, decode, decode_context, prefill_context = chunk_shape(request.prompt_len, request.num_computed, n)
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.decode_context += decode_context
        self.prefill_context += prefill_context


def chunk_shape(prompt_len: int, num_computed: int, n: int) -> tuple[int, int, int, int]:
    """A chunk of `n` tokens after `num_computed` as (prefill tokens, decode tokens, decode context,
    prefill context): a decode when it computes one generated token's KV. Its context is the KV its
    attention reads, summed over its tokens (each reads itself and every token before it): for a
    decode, its whole context; for a prompt chunk, (query, key) pairs."""
    context = n * num_computed + n * (n + 1) // 2
    return (0, 1, context, 0) if n == 1 and num_computed >= prompt_len else (n, 0, 0, context)


class SimEngine:
    def __init__(self, spec: EngineSpec, cost: StepCost, policies: Mapping[str, str] | None = None):
        names = {hook: registry.DEFAULTS[hook] for hook in HOOKS} | dict(policies or {})
        unknown = set(names) - set(HOOKS)
        if unknown:
            raise KeyError(f"the simulator runs the hooks {', '.join(HOOKS)}; not {', '.join(sorted(unknown))}")
        if names["kv_allocation"] not in ALLOCATIONS:
            raise ValueError(f"kv_allocation {names['kv_allocation']!r} allots ahead, a step the simulator does not "
                             f"take yet (docs/sim.md); it runs {', '.join(ALLOCATIONS)}")
        self.spec = spec
        self.cost = cost
        self.names = names
        self.policies = {hook: registry.resolve(hook, name) for hook, name in names.items()}
        self.free = spec.device_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.pulling: list[SimRequest] = []
        self.held: dict[str, SimRequest] = {}  # ended on this engine, their KV held for a decode engine
        self.refused: list[SimRequest] = []
        self.preemptions: list[tuple[float, str, str]] = []  # (when, request id, strategy)

    def pool_view(self) -> PoolView:
        return PoolView(block_size=self.spec.block_size, num_layers=self.spec.num_layers,
                        free={"device": self.free}, total={"device": self.spec.device_blocks})

    def add(self, request: SimRequest) -> bool:
        """Queue a request, unless at its longest it could never fit in the pool (the native engine's
        max_model_len refuses it): then it is `refused`, never runs, and this answers False."""
        fits = self.fits(request)
        (self.waiting if fits else self.refused).append(request)
        return fits

    def fits(self, request: SimRequest) -> bool:
        """Whether the pool could hold the request at its longest."""
        longest = blocks_for(request.prompt_len + request.max_tokens, self.spec.block_size) * self.spec.num_layers
        return longest <= self.spec.device_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def seconds(self, step: Step) -> float:
        return self.cost.seconds(step.prefill_tokens, step.decode_tokens, step.decode_context, step.prefill_context)

    # -- one iteration ----------------------------------------------------------------------------

    def schedule(self, now: float) -> Step:
        step = Step()
        budget = self._reserve_running(step, self.spec.token_budget)
        if not step.preempted:  # nobody lost their place for want of blocks
            self._admit_waiting(step, budget, now)
        self.preemptions += [(now, request_id, strategy) for request_id, strategy in step.preempted]
        return step

    def complete(self, step: Step, done: float) -> None:
        """The step's KV is computed; a chunk that reached its request's last token samples the next."""
        for request, n in step.chunks:
            samples = request.num_computed + n == request.num_tokens
            request.num_computed += n
            if samples:
                request.token_times.append(done)
                if request.num_generated >= request.max_tokens:
                    self._finish(request, done)

    def pulled(self, request: SimRequest) -> None:
        """Its KV has arrived: it decodes from its last prompt token on."""
        self.pulling.remove(request)
        request.num_computed, request.kv_elsewhere = request.kv_elsewhere, 0
        self.running.append(request)

    def release_held(self, request_id: str) -> None:
        """A decode engine has its KV (COMPLETE): the blocks are free."""
        self._release(self.held.pop(request_id))

    def _reserve_running(self, step: Step, budget: int) -> int:
        pending = list(self.running)
        while pending and budget > 0:
            request = pending.pop(0)
            n = min(request.uncomputed_tokens, budget)
            while not self._reserve(request, n):
                victim = self._pick_victim(pending + [request])
                self._preempt(victim, step)
                if victim is request:
                    break
                pending.remove(victim)
            if request in self.running:
                step.add(request, n)
                budget -= n
        return budget

    def _admit_waiting(self, step: Step, budget: int, now: float) -> None:
        if not self.waiting:
            return
        by_id = {r.request_id: r for r in self.waiting}
        order = self.policies["prefill_admission"]([r.view() for r in self.waiting],
                                                   [r.view() for r in self.running], self.pool_view(), now)
        for request_id in order:
            if budget <= 0 or len(self.running) >= self.spec.max_num_seqs:
                return
            request = by_id[request_id]
            if request.kv_elsewhere:
                if not self._start_pull(request, step, now):
                    return
                continue
            n = min(request.uncomputed_tokens, budget)
            if not self._reserve(request, n):
                return  # it waits its turn: nobody behind it goes first
            self.waiting.remove(request)
            request.scheduled_at = request.scheduled_at if request.scheduled_at is not None else now
            self.running.append(request)
            step.add(request, n)
            budget -= n

    def _start_pull(self, request: SimRequest, step: Step, now: float) -> bool:
        """Blocks for the KV held elsewhere, as for any request (nothing computed, no budget spent)."""
        if len(self.running) + len(self.pulling) >= self.spec.max_num_seqs or \
                not self._reserve(request, request.kv_elsewhere):
            return False
        self.waiting.remove(request)
        request.scheduled_at = request.scheduled_at if request.scheduled_at is not None else now
        self.pulling.append(request)
        step.pulls.append(request)
        return True

    def _reserve(self, request: SimRequest, n: int) -> bool:
        """Blocks for the request's KV after `n` more tokens; all or nothing."""
        extra = max(0, blocks_for(request.num_computed + n, self.spec.block_size) - request.blocks_per_layer)
        if extra * self.spec.num_layers > self.free:
            return False
        self.free -= extra * self.spec.num_layers
        request.blocks_per_layer += extra
        return True

    def _pick_victim(self, candidates: list[SimRequest]) -> SimRequest:
        by_id = {r.request_id: r for r in candidates}
        order = self.policies["preemption_order"]([r.view() for r in candidates], self.pool_view())
        return by_id[order[0]]

    def _preempt(self, victim: SimRequest, step: Step) -> None:
        """Recompute: with no cxl tier, as the native engine does whatever the strategy policy says."""
        victim.preemptions += 1
        self.running.remove(victim)
        self._release(victim)
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        step.preempted.append((victim.request_id, "recompute"))

    def _release(self, request: SimRequest) -> None:
        self.free += request.blocks_per_layer * self.spec.num_layers
        request.blocks_per_layer = 0

    def _finish(self, request: SimRequest, done: float) -> None:
        self.running.remove(request)
        if request.hold_kv:
            self.held[request.request_id] = request
        else:
            self._release(request)
        request.finished_at = done
