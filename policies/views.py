"""Read-only views the engine hands its policies: what the papers' equations read, nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import msgspec

from .costs import OffloadCost, PrefillCost, SwapCurves


class RequestView(msgspec.Struct, frozen=True):
    """A request as its engine's policies see it. A msgspec Struct rather than a frozen dataclass: a
    scheduler builds one for every waiting and running request each step, and a Struct is built
    about seven times faster (0.46 against 3.4 us), which the simulator's many engines feel."""

    request_id: str
    arrival: float            # seconds, engine clock
    prompt_len: int
    num_tokens: int           # prompt + generated so far
    num_computed: int         # tokens whose KV is in the cache
    num_generated: int
    max_tokens: int
    blocks_per_layer: int     # blocks the request holds in each layer
    tier: str                 # where those blocks are: "device", or "cxl" when swapped out
    preemptions: int = 0
    tbt_slo_ms: float | None = None          # SLO_tbt; None: the request has none
    predicted_output_len: int | None = None  # the estimated output length (padded prediction); None: not predicted
    ttft_slo_ms: float | None = None         # SLO_tft; None: the request has none
    allocation: int | None = None            # a_i, tokens of KV allotted (CacheOpt 3.3); None: blocks as it goes
    last_token_at: float | None = None       # when its last token came out (engine clock); None: none yet
    last_token_gap_s: float | None = None    # the time between its last two tokens; None: fewer than two
    first_token_at: float | None = None      # when its first token came out (engine clock); None: none yet
    scheduled_at: float | None = None        # when it first got blocks (engine clock); None: still queued
    predicted_output_low: int | None = None     # lower bound of the predicted output-length range (LayerKV 3.1)
    predicted_output_median: int | None = None  # the range's median (LayerKV Eq. 5's finishing estimate)
    device_layers: int | None = None         # layers whose KV is on the device tier (LayerKV); None: all
    cached_device_blocks: int = 0            # CaR: leading prompt blocks a prefix lookup finds on the device now
    cached_cxl_blocks: int = 0               # CaR: blocks after those found cached, with some in the cxl tier
    window_since: float | None = None        # CaR: when it entered the Shuffled Window; None: not in it

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_generated

    @property
    def uncomputed_tokens(self) -> int:
        """Tokens whose KV is still to compute: the rest of its prompt, or 1 while it decodes."""
        return self.num_tokens - self.num_computed

    @property
    def predicted_remaining_tokens(self) -> int:
        """Output tokens still to come by the prediction (capped by max_tokens), or by max_tokens
        when there is none; 0 once the request has outrun its prediction."""
        return max(0, self.estimated_output_len - self.num_generated)

    @property
    def estimated_output_len(self) -> int:
        """s_i^o: the estimated output length, capped by max_tokens; max_tokens without a prediction."""
        return self.max_tokens if self.predicted_output_len is None else min(self.predicted_output_len,
                                                                              self.max_tokens)


@dataclass(frozen=True, slots=True)
class PoolView:
    block_size: int
    num_layers: int
    free: Mapping[str, int]    # per tier: blocks free now (cached-but-unused ones included)
    total: Mapping[str, int]
    swap_curves: SwapCurves | None = None   # profiled swap and recompute times (CacheOpt 3.5); None: not profiled
    prefill_cost: PrefillCost | None = None  # LayerKV Eq. 3's fit, profiled at start; None: not profiled
    offload_cost: OffloadCost | None = None  # LayerKV Eq. 4's fit, profiled at start; None: not profiled

    def blocks_for(self, tokens: int) -> int:
        """Blocks one layer needs for `tokens` tokens."""
        return blocks_for(tokens, self.block_size)


@dataclass(frozen=True, slots=True)
class CachedBlockView:
    """A prefix block nobody uses now, kept for reuse until its space is needed."""

    node_id: str
    last_access: float
    hits: int
    score: float = 0.0        # CaR III-B.3
    tier: str = "device"      # where its blocks are
    depth: int = 0            # its block's index in the prompt: 0 for the first block of a prefix chain


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that `tokens` tokens fill (the last one partly)."""
    return -(-tokens // block_size)
