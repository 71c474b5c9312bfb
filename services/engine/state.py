"""`GET /v1/state`: what an engine reports of itself, on either backend, and the start-up profiles
the native engine's state carries (its fits of the papers' cost models)."""

from __future__ import annotations

import msgspec

from kvmesh.libs.messages.engine import TransferStats
from kvmesh.policies.costs import OffloadCost, PrefillCost, SwapCurves


class TransferTotals(msgspec.Struct, kw_only=True):
    """Decode role: what this engine's KV pulls have moved, all time."""

    pulls: int = 0
    bytes: int = 0
    pieces: int = 0          # contiguous block pieces asked for
    reads_posted: int = 0    # reads posted after coalescing
    seconds: float = 0.0

    def add(self, stats: TransferStats) -> None:
        self.pulls += 1
        self.bytes += stats.bytes
        self.pieces += stats.pieces
        self.reads_posted += stats.reads_posted
        self.seconds += stats.seconds


class SwapProfile(msgspec.Struct, kw_only=True):
    """What was timed (median seconds at each length) and the fit; `curves` is None when it failed."""

    lengths: list[int]
    recompute_s: list[float]
    swap_s: list[float]
    curves: SwapCurves | None


class LayerProfile(msgspec.Struct, kw_only=True):
    """What was timed (median seconds) and the fits; a cost is None when its fit failed."""

    flops_per_s: float
    lengths: list[int]
    prefill_s: list[float]
    copy_blocks: list[int]
    copy_s: list[float]
    bandwidth_bytes_per_s: float
    prefill_cost: PrefillCost | None
    offload_cost: OffloadCost | None


class SparsityProfile(msgspec.Struct, kw_only=True):
    sparsity: list[float]        # per layer: share of causal attention scores under 1% of their row's maximum
    keep_ratios: list[float]     # per layer: share of a node's tokens kept when it moves to the cxl tier
    keep_tokens: list[int]       # per layer: of each block's tokens
    quality_cost: float          # nats: mean |change| of held-out next-token log-likelihoods against dense KV
    quality_bound: float
    relaxations: int             # times the profiled ratios were relaxed to meet the bound
    configured: bool             # the ratios came from the configuration, not the profile


class EngineState(msgspec.Struct, kw_only=True):
    """`GET /v1/state`: free blocks per tier, queue lengths and all-time counters, replaced whole by the
    engine's thread (the metrics and the heartbeats read the same snapshot). Fields one backend
    lacks keep their defaults there."""

    backend: str = "native"
    free_blocks: dict[str, int]
    total_blocks: dict[str, int]
    block_size: int  # tokens a KV block holds
    max_num_seqs: int  # the most requests running at once
    token_budget: int  # the most tokens a step computes
    waiting: int
    running: int
    swapped: int
    pulling: int    # decode role: requests whose KV is being pulled
    held_kv: int    # prefill role: finished requests whose KV waits for a decode engine
    pushing: int = 0  # prefill role, push mode: requests whose blocks stay until their writes land (native)
    policies: dict[str, str]
    preemptions: dict[str, int]                # all time, by strategy (vLLM only recomputes)
    unallocated_tokens: int                    # KV allotted to nobody, the reservation left out (CacheOpt 3.3)
    allocations_grown: dict[str, int]          # all time: allocations a request outgrew, grown from where
    # All time, for the metrics (metrics.py reads this snapshot when scraped).
    generated_tokens: int
    computed_prompt_tokens: int                # of prompts, tokens whose KV this engine computed
    prefix_cache_hit_tokens: int               # and those it did not (vLLM: its prefix cache, and KV pulled)
    kv_transfer: TransferTotals                # decode role: the KV pulls
    prefix_cache_lookup_blocks: dict[str, int] = {}  # for each tier the cache holds: full blocks looked up (in all)
    prefix_cache_hit_blocks: dict[str, int] = {}     # by tier: of those, found there
    prefix_cache_nodes: dict[str, int] = {}          # now: cached nodes (a block in every layer) by tier
    prefix_cache_moved_nodes: dict[str, int] = {}    # all time: nodes moved to a tier (cxl: offloaded, device: reloaded)
    prefix_cache_moved_bytes: dict[str, int] = {}    # all time: the KV bytes those moves copied
    # The native engine's
    tbt_ms_p50: float | None = None
    tbt_ms_p99: float | None = None
    steps: int = 0
    layers_offloaded: dict[str, int] = {}      # all time: request layers LayerKV put in the cxl tier, by why, or restored
    swap_profile: SwapProfile | None = None    # CacheOpt 3.5's start-up profile and fitted curves; None: not profiled
    layer_profile: LayerProfile | None = None  # LayerKV's start-up fits of Eq. 3 and 4; None: not profiled
    sparsity_profile: SparsityProfile | None = None  # CaR III-D's per-layer sparsity and keep ratios; None: off
    # The vLLM backend's (KVMeshScheduler's)
    prefill_cost: PrefillCost | None = None    # LayerKV Eq. 3's fit on this engine; None: not profiled
    prefills_held_back: int = 0                # all time: waiting requests the admission or allocation policy kept out of a step
    recent_preemptions: list[str] = []         # the latest victims, oldest first: vLLM's ids (ours, "-" and its suffix)
