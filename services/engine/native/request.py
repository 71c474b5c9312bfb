"""A request's state inside the engine: tokens, how far its KV is computed, where its blocks are."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvmesh.libs.messages.engine import KVHandle, SamplingParams, Targets, TransferStats
from kvmesh.policies.iteration.status import Status
from kvmesh.policies.views import RequestView


class KVPushTarget(Protocol):
    """What the engine thread asks of a push in flight (libs/rdma/kvdirect/pusher.py's LayerPush):
    each layer's blocks from `first` on written as a step computes them, then no more writes, and
    whether they all landed (None) or why not."""

    landed: Future[str | None]

    def layer_done(self, layer: int, first: int, blocks: list[int]) -> None: ...

    def finish(self) -> None: ...


@dataclass
class LayerBlocks:
    """One layer's blocks of a request, and the tier they are in (LayerKV moves layers one by one)."""

    tier: str
    blocks: list[int] = field(default_factory=list)


@dataclass(eq=False)  # one request is itself: the scheduler finds it in its queues by identity, as SimRequest
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: float
    num_layers: int
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_times: list[float] = field(default_factory=list)
    num_computed: int = 0                  # tokens whose KV is in the cache
    num_cached: int = 0                    # of the prompt, tokens reused from the prefix cache
    status: Status = Status.WAITING
    preemptions: int = 0
    finish_reason: str | None = None
    text: str = ""                         # detokenised output so far
    sent_chars: int = 0                    # of `text`, how much the client has
    prefix_offset: int = 0                 # output tokens decoded as context for the next one
    read_offset: int = 0                   # output tokens whose text is in `text`
    node_ids: list[str] = field(default_factory=list)     # NodeIDs of the full blocks, in order
    cached_nodes: list[str] = field(default_factory=list)  # prefix-cache nodes this request holds a ref on
    scores: dict = field(default_factory=dict)  # CaR: node id -> (node, what this request added to its score)
    window_since: float | None = None      # CaR: when it entered the scheduler's Shuffled Window
    cache_hits: tuple[int, int] = (0, 0)   # CaR: leading prompt blocks cached on the device, then in the cxl tier
    num_committed: int = 0                 # leading full blocks already offered to the prefix cache
    generator: torch.Generator | None = None
    scheduled_at: float | None = None      # when it first got blocks (compute or a pull): the end of its queueing
    pull_times: tuple[float, float] | None = None  # decode role: when its KV pull started and ended
    transfer: TransferStats | None = None  # decode role: what the pull moved
    hold_kv: bool = False                  # prefill role: keep the prompt's KV for a decode engine when done
    push: KVPushTarget | None = None       # prefill role, push mode: each chunk's KV written there as computed
    push_from: int = 0                     # push mode: the first block the next chunk's writes start from
    kv_source: KVHandle | None = None      # decode role: where the prompt's KV is, until it has arrived
    reservation: bool = False              # decode role, push mode: blocks held for KV a prefill engine writes
    kv_deadline: float | None = None       # a reservation nobody claims is freed then
    targets: Targets = Targets()
    # CacheOpt 3.3's ledger: tokens of KV allotted (None: blocks as it goes), and allocation this
    # request hands on when it ends, (request id, tokens): back to its host when it was embedded,
    # to a borrower when it lends.
    allocation: int | None = None
    passes: list[tuple[str, int]] = field(default_factory=list)
    guests: list[str] = field(default_factory=list)   # requests embedded in its allotted KV
    layers: list[LayerBlocks] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = [LayerBlocks("device") for _ in range(self.num_layers)]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def blocks_per_layer(self) -> int:
        return len(self.layers[0].blocks)

    @property
    def tier(self) -> str:
        """"device" while any layer's KV is there, else where it all is ("cxl": swapped out, or
        LayerKV keeping no layer on the device)."""
        return "device" if any(layer.tier == "device" for layer in self.layers) else self.layers[0].tier

    @property
    def device_layers(self) -> int:
        return sum(layer.tier == "device" for layer in self.layers)

    @property
    def offloaded(self) -> list[int]:
        """Layers whose KV is in the cxl tier while the request runs (LayerKV)."""
        return [i for i, layer in enumerate(self.layers) if layer.tier != "device"]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def awaits_kv(self) -> bool:
        """Decode role: its prompt's KV comes from a prefill engine (pulled, or pushed into a reservation)."""
        return self.kv_source is not None or self.reservation

    def view(self) -> RequestView:
        """What the policies see of the request."""
        return RequestView(request_id=self.request_id, arrival=self.arrival, prompt_len=len(self.prompt_ids),
                           num_tokens=self.num_tokens, num_computed=self.num_computed,
                           num_generated=len(self.output_ids), max_tokens=self.sampling.max_tokens,
                           blocks_per_layer=self.blocks_per_layer, tier=self.tier,
                           preemptions=self.preemptions, tbt_slo_ms=self.targets.tbt_slo_ms,
                           predicted_output_len=self.targets.predicted_output_len,
                           ttft_slo_ms=self.targets.ttft_slo_ms, allocation=self.allocation,
                           last_token_at=self.output_times[-1] if self.output_times else None,
                           last_token_gap_s=(self.output_times[-1] - self.output_times[-2]
                                             if len(self.output_times) > 1 else None),
                           first_token_at=self.output_times[0] if self.output_times else None,
                           scheduled_at=self.scheduled_at, predicted_output_low=self.targets.predicted_output_low,
                           predicted_output_median=self.targets.predicted_output_median,
                           device_layers=self.device_layers, cached_device_blocks=self.cache_hits[0],
                           cached_cxl_blocks=self.cache_hits[1], window_since=self.window_since)
