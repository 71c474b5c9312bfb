"""A simulated request: how far its KV is computed, the blocks it holds, when each token came out.
It carries what the iteration scheduler asks of a request (policies/iteration/seams.py's Schedulable)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.policies.iteration import Status
from kvmesh.policies.views import RequestView


@dataclass(frozen=True, slots=True)
class LayerTier:
    """One layer of a request: the tier its KV is in."""

    tier: str


@dataclass(eq=False)  # one request is itself: the scheduler finds it in its queues by identity
class SimRequest:
    request_id: str
    arrival: float
    prompt_len: int
    max_tokens: int                  # its output length: it runs to max_tokens, as with ignore_eos
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    predicted_output_len: int | None = None
    predicted_output_low: int | None = None     # the predicted range's lower bound (LayerKV Eq. 1)
    predicted_output_median: int | None = None  # and its median (LayerKV Eq. 5)
    kv_elsewhere: int = 0            # decode role: leading tokens whose KV another engine holds, to pull
    hold_kv: bool = False            # prefill role: its KV stays held for a decode engine when it ends
    push: object | None = None       # prefill role, push mode: where its KV is written (its decode engine's id)
    num_computed: int = 0            # tokens whose KV is in the cache
    blocks_per_layer: int = 0
    tier: str = "device"             # where its KV is: "cxl" while swapped out
    preemptions: int = 0
    scheduled_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None
    transfer_s: float | None = None  # disaggregated: its KV hand-off, from the pull's start to its COMPLETE
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_cached: int = 0              # of the prompt, tokens from the prefix cache
    # CacheOpt 3.3's ledger (policies/allocation/ledger.py): tokens allotted (None: blocks as it
    # goes), allocation handed on when it ends, and the requests embedded in its allotment.
    allocation: int | None = None
    passes: list[tuple[str, int]] = field(default_factory=list)
    guests: list[str] = field(default_factory=list)
    # The prefix cache (prefix_count.py). `block_names`: its full blocks' content names, in order,
    # prompt and output (a conversation's next turn names this turn's blocks first); the others
    # are what the native engine's Request keeps for the cache and for CaR.
    block_names: tuple[str, ...] = ()
    cached_nodes: list[str] = field(default_factory=list)  # node ids it holds
    num_committed: int = 0           # leading full blocks already offered to the prefix cache
    scores: dict = field(default_factory=dict)  # CaR: node id -> (node, what it added to the node's score)
    window_since: float | None = None  # CaR: when it entered the Shuffled Window
    cache_hits: tuple[int, int] = (0, 0)  # CaR: leading blocks cached on the device, then in the cxl tier
    # LayerKV (policies/iteration/seams.py's LayeredRequest), kept by sim/layer_count.py: each layer's
    # tier, the layers in the cxl tier and how many are on the device; empty and None for a request
    # never counted layer by layer (its layers all in `tier`). A pushed prompt is not placed layer by
    # layer: every layer stays on the device for its writes, as the native scheduler reads `push`.
    layers: Sequence[LayerTier] = ()
    offloaded: tuple[int, ...] = ()
    device_layers: int | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_times)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def awaits_kv(self) -> bool:
        return self.kv_elsewhere > 0

    def view(self) -> RequestView:
        """What the policies see, field for field as the native engine's Request.view() fills it."""
        times = self.token_times
        return RequestView(request_id=self.request_id, arrival=self.arrival, prompt_len=self.prompt_len,
                           num_tokens=self.num_tokens, num_computed=self.num_computed,
                           num_generated=self.num_generated, max_tokens=self.max_tokens,
                           blocks_per_layer=self.blocks_per_layer, tier=self.tier, preemptions=self.preemptions,
                           tbt_slo_ms=self.tbt_slo_ms, predicted_output_len=self.predicted_output_len,
                           predicted_output_low=self.predicted_output_low,
                           predicted_output_median=self.predicted_output_median,
                           ttft_slo_ms=self.ttft_slo_ms, allocation=self.allocation,
                           last_token_at=times[-1] if times else None,
                           last_token_gap_s=times[-1] - times[-2] if len(times) > 1 else None,
                           first_token_at=times[0] if times else None, scheduled_at=self.scheduled_at,
                           device_layers=self.device_layers, cached_device_blocks=self.cache_hits[0],
                           cached_cxl_blocks=self.cache_hits[1], window_since=self.window_since)
