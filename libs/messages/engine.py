"""The engine API's bodies (docs/serving.md; docs/api/engine.openapi.json): what admission sends an
engine and reads back, the KV hand-off's handle between a prefill and a decode engine, and the
engine's control routes. The engine service (either backend) and its callers both import these."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from kvmesh.libs.controlplane import BadRequest
from kvmesh.libs.kvmeta.messages import Id

BlockIds = Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=1 << 16)]


class KVHandle(Struct, kw_only=True, frozen=True):
    """Where a request's prompt KV sits: on which engine (control id and data-plane address), under
    which request id there, how many tokens, and each layer's blocks in order."""

    engine: Id
    data_address: Annotated[str, Meta(min_length=1, max_length=256)]
    request_id: Id
    num_tokens: Annotated[int, Meta(gt=0)]
    block_size: Annotated[int, Meta(gt=0)]
    layers: Annotated[list[BlockIds], Meta(max_length=1024)]
    # Each layer's tier on that engine ("device" or "cxl", where LayerKV keeps some); None: all device.
    tiers: Annotated[list[Annotated[str, Meta(pattern="^(device|cxl)$")]], Meta(max_length=1024)] | None = None

    def check(self, num_layers: int, block_size: int, kv_tokens: int) -> None:
        """400 unless the handle fits this engine and a prompt whose first `kv_tokens` have KV there."""
        if self.block_size != block_size or len(self.layers) != num_layers:
            raise BadRequest(f"kv_source: blocks of {self.block_size} tokens in {len(self.layers)} layers do not fit "
                             f"this engine ({block_size} tokens, {num_layers} layers)")
        if self.num_tokens != kv_tokens:
            raise BadRequest(f"kv_source holds {self.num_tokens} tokens, but all but the last of the "
                             f"{kv_tokens + 1} prompt tokens ({kv_tokens}) must have KV there")
        if self.tiers is not None and len(self.tiers) != len(self.layers):
            raise BadRequest(f"kv_source: {len(self.tiers)} tiers for {len(self.layers)} layers")
        needed = -(-kv_tokens // block_size)
        if any(len(blocks) < needed for blocks in self.layers):
            raise BadRequest(f"kv_source: every layer needs {needed} blocks for {kv_tokens} tokens")


class KVTransfer(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """On a prefill engine: keep the prompt's KV for a decode engine to pull (pull mode), or write
    it into the blocks a decode engine reserved (push mode, `target` from its /v1/kv/reserve)."""

    mode: Annotated[str, Meta(pattern="^(pull|push)$")] = "pull"
    target: KVHandle | None = None


class KVReserve(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/kv/reserve` on a decode engine (push mode): blocks for `num_tokens` tokens of KV."""

    request_id: Id
    num_tokens: Annotated[int, Meta(gt=0)]


class TransferStats(Struct, kw_only=True, frozen=True):
    """What one request's KV pull moved, for its trace and the transfer metrics."""

    bytes: int
    pieces: int        # contiguous block pieces asked for
    reads_posted: int  # reads posted after coalescing
    seconds: float     # from the first read posted to the prefill side's ACK of COMPLETE
    backend: str       # tcp | shm | verbs
    peer: str          # the prefill engine's data-plane address


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0       # 0 is greedy
    top_k: int = 0                 # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Targets(Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What admission says of a request beyond its tokens, for the policies: its SLOs and the
    predictor's output length, padded (CacheOpt 3.4) and as a range (LayerKV); None where it has none."""

    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    predicted_output_len: int | None = None
    predicted_output_low: int | None = None     # the predicted range's lower bound and median (LayerKV 3.1)
    predicted_output_median: int | None = None

    def check(self) -> None:
        """400 unless the SLOs are positive and the predicted lengths at least 1, low <= median."""
        for name in ("ttft_slo_ms", "tbt_slo_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise BadRequest(f"{name} must be a positive number of milliseconds, got {value}")
        for name in ("predicted_output_len", "predicted_output_low", "predicted_output_median"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadRequest(f"{name} must be at least 1, got {value}")
        low, median = self.predicted_output_low, self.predicted_output_median
        if low is not None and median is not None and low > median:
            raise BadRequest(f"predicted_output_low ({low}) is above predicted_output_median ({median})")


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Timings(Struct, kw_only=True, omit_defaults=True):
    """Where a finished request's time went on this engine (unix seconds), for latency breakdowns."""

    arrival: float
    scheduled: float | None = None      # first given blocks: queueing ends
    pull_start: float | None = None     # decode role: its KV transfer
    pull_end: float | None = None
    first_token: float | None = None
    finished: float | None = None
    transfer: TransferStats | None = None  # decode role: what the pull moved


class Frame(Struct, kw_only=True, omit_defaults=True):
    """What a client receives after a step: the new tokens of one request."""

    request_id: str
    token_ids: list[int]
    text: str
    times: list[float]                    # unix time each token was produced
    logprobs: list[float] | None = None
    finish_reason: str | None = None      # "stop", "length", "abort", "error"
    usage: Usage | None = None
    kv_handle: KVHandle | None = None     # prefill role: where the prompt's KV waits for a decode engine
    timings: Timings | None = None        # on the last frame


class GenerateRequest(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`POST /v1/generate`: a prompt (text or token ids) and how to sample its continuation."""

    request_id: Id | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Annotated[list[str], Meta(max_length=16)] = field(default_factory=list)
    stop_token_ids: Annotated[list[int], Meta(max_length=64)] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    kv_transfer: KVTransfer | None = None  # prefill role: keep the prompt's KV for a decode engine
    kv_source: KVHandle | None = None      # decode role: the prompt's KV (all but its last token) is there
    targets: Targets = Targets()           # the request's SLOs and predicted output length, for the policies

    def validated(self, tokenizer, vocab_size: int, max_model_len: int) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling parameters, or a 400 saying what is wrong."""
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise BadRequest("give exactly one of `prompt` and `prompt_token_ids`")
        ids = tokenizer.encode(self.prompt) if self.prompt is not None else list(self.prompt_token_ids)
        if not ids or (self.prompt is not None and not self.prompt):
            raise BadRequest("the prompt is empty")
        outside = [t for t in ids + self.stop_token_ids if not 0 <= t < vocab_size]
        if outside:
            raise BadRequest(f"token ids outside the vocabulary [0, {vocab_size}): {outside[:8]}")
        if self.max_tokens <= 0:
            raise BadRequest(f"max_tokens must be at least 1, got {self.max_tokens}")
        if len(ids) + self.max_tokens > max_model_len:
            raise BadRequest(f"the prompt ({len(ids)} tokens) plus max_tokens ({self.max_tokens}) is over this "
                             f"engine's context limit of {max_model_len} tokens")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise BadRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadRequest(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise BadRequest("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise BadRequest(f"seed must be in [0, 2**63), got {self.seed}")
        if self.kv_transfer is not None and self.max_tokens != 1:
            raise BadRequest("kv_transfer: a prefill engine samples only the first token (max_tokens 1); "
                             "the decode engine samples the rest")
        if self.kv_source is not None and len(ids) < 2:
            raise BadRequest("kv_source: the prompt must be the prefilled tokens plus the first sampled token")
        return ids, SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                                   top_p=self.top_p, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                                   stop=tuple(self.stop), ignore_eos=self.ignore_eos, logprobs=self.logprobs)


class PrefillRequest(GenerateRequest, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/prefill`: compute the prompt, sample its first token and keep the prompt's KV for a
    decode engine (pulled from here, unless `kv_transfer` pushes it); the last frame has the handle."""

    max_tokens: int = 1
    kv_transfer: KVTransfer = field(default_factory=KVTransfer)

    def __post_init__(self) -> None:
        if self.kv_source is not None:
            raise ValueError("a prefill computes its prompt's KV: kv_source (KV to load) belongs on /v1/decode")


class DecodeRequest(GenerateRequest, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/decode`: the prompt and the first token a prefill engine sampled, `kv_source` the
    prompt's KV there; loads that KV and generates the rest."""

    kv_source: KVHandle

    def __post_init__(self) -> None:
        if self.kv_transfer is not None:
            raise ValueError("a decode loads its prompt's KV: kv_transfer (KV to keep for another engine) "
                             "belongs on /v1/prefill")


class AbortRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: Id


class Aborted(Struct, kw_only=True):
    aborted: bool


class PolicyNames(Struct, kw_only=True, forbid_unknown_fields=True):
    """Engine-level policies by hook: prefill_admission, kv_allocation, preemption_order,
    preemption_strategy, cache_policy, layer_offload."""

    policies: dict[str, str]


class CacheQuery(Struct, kw_only=True, frozen=True):
    tier: Literal["device", "cxl"] | None = None   # only nodes in this tier
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 1000


class CacheEntry(Struct, kw_only=True):
    """One row of CaR's cache table (III-B.1): a prefix-cache node, a block in every layer."""

    node_id: str
    tier: str              # where its blocks are: device (Valid_in_GPU) or cxl
    blocks: list[int]      # Addr: its block in each layer of that tier's pool
    size_bytes: int        # Size
    valid_in_gpu: bool
    score: int             # Score: what live requests that will use it added (III-B.3)
    refs: int              # requests holding it now
    hits: int
    last_access: float     # engine clock


class CacheTable(Struct, kw_only=True):
    entries: list[CacheEntry]   # highest score first, then most recently used
    total: dict[str, int]       # nodes by tier, all of them


class TokenizerSpec(Struct, kw_only=True):
    """`GET /v1/tokenizer`: what a front door needs to tokenize for this engine's model itself."""

    model: str
    tokenizer_json: str                   # the `tokenizers` library's serialisation
    chat_template: str | None
    special_tokens: dict[str, str]        # bos_token, eos_token, unk_token, pad_token when set
    eos_token_ids: list[int]
    max_model_len: int
