"""A simulated colocated engine: the native engine's iteration scheduler (policies/iteration/, the same
class services/engine/native/scheduler.py runs) over a count of blocks (block_count.py) instead of
KV pools. Every decision is the native engine's: running requests first, preempting by the policy
when blocks run short (a swap to the cxl tier when the strategy says so and it has room), then the
swapped-out ones, then waiting ones in the admission policy's order, with any kv_allocation policy
(allocation ahead through CacheOpt's ledger), and LayerKV's layer offload (layer by layer in
layer_count.py, a step's staged layers timed by staging_time.py). A step lasts what the step cost
says, with its staged layers' copies overlapped, plus the copies of its swaps (each one's fixed cost
and its bytes over the bandwidth, as a fitted profile's `tier` measured them) and layer moves (their
bytes).

With `prefix_caching` the count is prefix_count.py's: the prefix cache's nodes, evicted by the
cache_policy hook, and with `cache_cxl` CaR's cxl tier of nodes and its Shuffled Window and
prefetcher (policies/iteration/reuse.py, as the native engine runs them). Its copies go over
cache_links.py's links, one each way: a step waits for its room and for the prefetches of the nodes
its requests hold that have not landed; the copies in begun with it, its reloads at their turn
(layer by layer, CaR III-C.1) and its prefetches (III-B.2), run under its compute, and it ends once
they have landed, as the native engine settles them; the asynchronous offload past the high-water
mark (III-C.2) holds its link, not a step. Without a cxl tier an evicted node is dropped: nothing is
copied.

For disaggregation (sim/cluster.py moves the KV): a request with `hold_kv` keeps its blocks when it
ends, until `release_held`; one with `kv_elsewhere` is given blocks for that KV when admitted,
without computing it, and waits in `pulling` until `pulled`, as the native scheduler's decode role does."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvmesh.policies import registry
from kvmesh.policies.allocation import AllocationParams
from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.iteration import Policies, Scheduler
from kvmesh.policies.iteration.reuse import Reuse, WindowParams
from kvmesh.policies.offload import OffloadParams
from kvmesh.policies.step_shape import chunk_shape
from kvmesh.policies.views import PoolView, blocks_for

from .block_count import BlockCount
from .cache_links import CacheLinks
from .layer_count import LayerCount
from .prefix_count import PrefixCount
from .request import SimRequest
from .staging_time import staged_step_s
from .step_cost import StepCost

# The hooks the simulator runs: all of the native engine's.
HOOKS = ("prefill_admission", "kv_allocation", "preemption_order", "preemption_strategy", "layer_offload",
         "cache_policy")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    block_size: int = 16
    num_layers: int = 1
    device_blocks: int = 4096     # the device tier's blocks, all layers together
    max_num_seqs: int = 64
    token_budget: int = 2048      # tokens computed per step (chunked prefill)
    chunked_prefill: bool = True  # False: vLLM v0's default, steps of whole prompts while decodes stall
    cxl_blocks: int = 0           # the cxl tier's blocks, all layers together (0: none, a swap recomputes)
    block_bytes: int = 0          # KV bytes of one block of one layer: what a swap copies per block
    swap_out_bytes_per_s: float = 25e9  # device to cxl copy bandwidth (PCIe 4.0 x16, one direction)
    swap_in_bytes_per_s: float = 25e9   # cxl to device
    swap_out_fixed_s: float = 0.0       # what a swap out costs whatever its size (a fitted profile's `tier`)
    swap_in_fixed_s: float = 0.0        # and a swap in
    # LayerKV: the most blocks a staged layer of a step may use (the scheduler's staging_cap; 0: no
    # layer-wise offloading), Eq. 5's threshold and horizon, and Eq. 3 and 4's fits (the native
    # engine profiles them at start; None: not profiled, every layer stays and Algorithm 1 admits all).
    staging_cap: int = 0
    offload: OffloadParams = OffloadParams()
    prefill_cost: PrefillCost | None = None
    offload_cost: OffloadCost | None = None
    # The prefix cache (prefix_count.py): on or off, CaR's cxl tier of nodes (needs a cxl tier), the
    # share of the device in use past which idle nodes move there after a step, CaR's Shuffled Window.
    prefix_caching: bool = False
    cache_cxl: bool = False
    cache_high_water: float = 0.9
    window: WindowParams = WindowParams()
    reload_overlap: bool = True   # CaR III-C.1: a turn's reloads load layer by layer under its step (False: before it)

    def __post_init__(self) -> None:
        if self.cxl_blocks and self.block_bytes <= 0:
            raise ValueError("a cxl tier needs block_bytes > 0: the bytes a swap copies per block")
        if self.staging_cap and not self.cxl_blocks:
            raise ValueError("layer-wise offloading (staging_cap) needs a cxl tier to offload to: cxl_blocks")
        if self.cache_cxl and not (self.prefix_caching and self.cxl_blocks):
            raise ValueError("cache_cxl keeps prefix-cache nodes in the cxl tier: it needs prefix_caching and "
                             "cxl_blocks")
        if self.staging_cap and not self.chunked_prefill:
            raise ValueError("whole prompts a step (chunked_prefill False) is vLLM v0's scheduler: no staging_cap")
        if self.prefix_caching and self.layered:
            raise ValueError("the simulator counts the prefix cache or LayerKV's layers, not both at once")

    @property
    def layered(self) -> bool:
        """Whether blocks are counted layer by layer: a staging area, or LayerKV's fits for the policies."""
        return bool(self.staging_cap) or self.prefill_cost is not None or self.offload_cost is not None


@dataclass
class Step:
    chunks: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, tokens its KV computes)
    pulls: list[SimRequest] = field(default_factory=list)               # given blocks: their KV to pull now
    preempted: list[tuple[str, str]] = field(default_factory=list)      # (request id, strategy carried out)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_context: int = 0
    prefill_context: int = 0
    prefill_sequences: int = 0
    swap_s: float = 0.0  # the copies of this step's swaps and layer moves between tiers, which it waits for
    staged: dict[int, tuple[float, float]] = field(default_factory=dict)  # LayerKV: staged layer -> (load, write) s
    staged_bytes: int = 0  # LayerKV: the bytes of those copies (the step cost's g term)
    cache_offload_s: float = 0.0  # the copies of prefix-cache nodes evicted to the cxl tier for its room
    cache_load_s: float = 0.0     # the copies of nodes reloaded at their turn (layer by layer) and prefetched

    def add(self, request: SimRequest, n: int) -> None:
        self.chunks.append((request, n))
        prefill, decode, decode_context, prefill_context, sequences = chunk_shape(request.prompt_len,
                                                                                 request.num_computed, n)
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.decode_context += decode_context
        self.prefill_context += prefill_context
        self.prefill_sequences += sequences


class SimEngine:
    def __init__(self, spec: EngineSpec, cost: StepCost, policies: Mapping[str, str] | None = None,
                 allocation: AllocationParams = AllocationParams()):
        names = {hook: registry.DEFAULTS[hook] for hook in HOOKS} | dict(policies or {})
        unknown = set(names) - set(HOOKS)
        if unknown:
            raise KeyError(f"the simulator runs the hooks {', '.join(HOOKS)}; not {', '.join(sorted(unknown))} "
                           "(docs/sim.md)")
        if names["layer_offload"] != "none" and not spec.staging_cap:
            raise ValueError(f"layer_offload {names['layer_offload']} needs a staging area: EngineSpec.staging_cap "
                             "and a cxl tier")
        self.spec = spec
        self.cost = cost
        self.names = names
        self.policies = Policies(names)
        tiers = {"device": spec.device_blocks} | ({"cxl": spec.cxl_blocks} if spec.cxl_blocks else {})
        # The prefix cache's copies to and from its cxl tier, timed on one link each way; None: it has none.
        self.links = CacheLinks(spec.swap_out_bytes_per_s, spec.swap_in_bytes_per_s) if spec.cache_cxl else None
        if spec.prefix_caching:
            self.blocks = PrefixCount(spec.block_size, spec.num_layers, tiers, self.policies.cache_policy,
                                      spec.block_bytes, spec.cache_cxl, spec.cache_high_water)
            self.blocks.links = self.links
        else:
            self.blocks = LayerCount(spec.block_size, spec.num_layers, tiers, spec.prefill_cost, spec.offload_cost) \
                if spec.layered else BlockCount(spec.block_size, spec.num_layers, tiers)
        # CaR's window, scores and prefetch, read at the cxl tier's bandwidth (the native engine times its own).
        reuse = Reuse(self.blocks, spec.window, spec.swap_in_bytes_per_s) if spec.prefix_caching else None
        self.scheduler = Scheduler(self.blocks, self.policies, spec.max_num_seqs, spec.token_budget, allocation,
                                   spec.staging_cap, spec.offload, reuse, spec.chunked_prefill)
        self.held: dict[str, SimRequest] = {}  # ended on this engine, their KV held for a decode engine
        self.refused: list[SimRequest] = []
        self.preemptions: list[tuple[float, str, str]] = []  # (when, request id, strategy)
        self.steps = 0  # steps completed, one at a time or in decode runs

    @property
    def free(self) -> int:
        """Free device blocks, all layers together."""
        return self.blocks.free("device")

    @property
    def waiting(self) -> deque[SimRequest]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[SimRequest]:
        return self.scheduler.running

    @property
    def swapped(self) -> deque[SimRequest]:
        return self.scheduler.swapped

    @property
    def pulling(self) -> list[SimRequest]:
        return self.scheduler.pulling

    def pool_view(self) -> PoolView:
        return self.blocks.pool_view()

    def add(self, request: SimRequest) -> bool:
        """Queue a request, unless at its longest it could never fit in the pool (the native engine's
        max_model_len refuses it): then it is `refused`, never runs, and this answers False."""
        fits = self.fits(request)
        if fits:
            self.scheduler.add(request)
        else:
            self.refused.append(request)
        return fits

    def fits(self, request: SimRequest) -> bool:
        """Whether the pool could hold the request at its longest, and, without chunked prefill, one
        step could compute it whole at its longest (a preempted request recomputes its answer too):
        vLLM v0 needs max_num_batched_tokens >= max_model_len there, and ignores a longer prompt."""
        tokens = request.prompt_len + request.max_tokens
        if not self.spec.chunked_prefill and tokens > self.spec.token_budget:
            return False
        return blocks_for(tokens, self.spec.block_size) * self.spec.num_layers <= self.spec.device_blocks

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def seconds(self, step: Step) -> float:
        compute = self.cost.seconds(step.prefill_tokens, step.decode_tokens, step.decode_context, step.prefill_context,
                                    step.prefill_sequences, step.staged_bytes)
        staged = staged_step_s(compute, self.spec.num_layers, step.staged)
        computed = max(staged, step.cache_load_s) if self.spec.reload_overlap else staged + step.cache_load_s
        return computed + step.swap_s + step.cache_offload_s

    # -- one iteration ----------------------------------------------------------------------------

    def schedule(self, now: float) -> Step:
        if self.links is not None:
            self.links.at(now)
        moved = self.blocks.moved.copy()
        swapped = len(self.scheduler.swapped)
        plan = self.scheduler.schedule(now)
        step = Step(pulls=list(plan.pulls), preempted=[(r.request_id, how) for r, how in plan.preempted])
        for chunk in plan.chunks:
            step.add(chunk.request, chunk.num_tokens)
            if chunk.request.offloaded and self.scheduler.staging_cap:
                self._stage(step, chunk.request)
        copied = self.blocks.moved - moved
        swaps_out = sum(how == "swap" for _, how in step.preempted)
        swaps_in = swapped + swaps_out - len(self.scheduler.swapped)  # only a swap in leaves `swapped` in a step
        step.swap_s = self.spec.block_bytes * (copied["cxl"] / self.spec.swap_out_bytes_per_s +
                                               copied["device"] / self.spec.swap_in_bytes_per_s) + \
            swaps_out * self.spec.swap_out_fixed_s + swaps_in * self.spec.swap_in_fixed_s
        if isinstance(self.blocks, PrefixCount):
            self._cache_copies(step)
        self.preemptions += [(now, request_id, strategy) for request_id, strategy in step.preempted]
        return step

    def _cache_copies(self, step: Step) -> None:
        """The prefix cache's copies this step waits for (the module's docstring); a step that computes
        nothing makes its reloads at once, as the native engine's flush_loads."""
        if self.links is not None:
            held = [node for request, _ in step.chunks for node in request.cached_nodes] if self.links.landing else []
            step.cache_offload_s, step.cache_load_s = self.links.waits(held)
        if not step.chunks:
            self.blocks.loads_done()

    def _stage(self, step: Step, request: SimRequest) -> None:
        """The copies of the request's offloaded layers this step (layer_staging.py's): its context
        loaded from the cxl tier, and the blocks the step writes into written back."""
        block_size, block_bytes = self.spec.block_size, self.spec.block_bytes
        loaded = blocks_for(request.num_computed, block_size) * block_bytes
        written = (request.blocks_per_layer - request.num_computed // block_size) * block_bytes
        step.staged_bytes += (loaded + written) * len(request.offloaded)
        load, write = loaded / self.spec.swap_in_bytes_per_s, written / self.spec.swap_out_bytes_per_s
        for layer in request.offloaded:
            loads, writes = step.staged.get(layer, (0.0, 0.0))
            step.staged[layer] = (loads + load, writes + write)

    def complete(self, step: Step, done: float) -> list[SimRequest]:
        """The step's KV is computed; a chunk that reached its request's last token samples the next.
        The blocks lent for its staging area are free again. The requests it ended."""
        if isinstance(self.blocks, LayerCount):
            self.blocks.give_back()
        self.scheduler.iteration_s.append(self.seconds(step))  # CacheOpt's T_I^max reads recent step times
        self.steps += 1
        sampling = [request for request, n in step.chunks if request.num_computed + n == request.num_tokens]
        for request, n in step.chunks:  # every chunk's KV first, offered to the prefix cache; then the samples
            request.num_computed += n
            self.blocks.commit(request, done)
        ended = []
        for request in sampling:
            request.token_times.append(done)
            if request.num_generated >= request.max_tokens:
                self.finish(request, done)
                ended.append(request)
        if self.links is not None:
            self.links.at(done)   # the idle offload is queued at the step's end
        if isinstance(self.blocks, PrefixCount):
            self.blocks.loads_done()
            self.blocks.offload_idle()  # CaR III-C.2: idle nodes out to the cxl tier past the high-water mark
        return ended

    def pulled(self, request: SimRequest) -> None:
        """Its KV has arrived: it decodes from its last prompt token on (a prefix cache stamps the
        pulled blocks it caches with the request's arrival: the cluster tells no time)."""
        request.kv_elsewhere = 0
        self.scheduler.pulled(request, request.arrival)

    def release_held(self, request_id: str) -> None:
        """A decode engine has its KV (COMPLETE): the blocks are free."""
        self.blocks.release(self.held.pop(request_id))

    def finish(self, request: SimRequest, done: float) -> None:
        """It sampled its last token at `done`: it leaves, its KV held if a decode engine is to pull it."""
        self.scheduler.finish(request, "length", release=not request.hold_kv)
        if request.hold_kv:
            self.held[request.request_id] = request
        request.finished_at = done
