"""The predictor API's bodies (docs/cacheopt.md, "The predictor service"; docs/api/predictor.openapi.json):
a prediction asked for and given, an observed length, and the predictor's settings. The predictor and
admission both import these."""

from __future__ import annotations

import math
from typing import Annotated

from msgspec import Meta, Struct, field

MAX_PROMPT_TOKENS = 262_144
MAX_PROMPT_CHARS = 1_048_576
MAX_LENGTH = 2**31 - 1  # tokens: any output length a request can ask for
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
Length = Annotated[int, Meta(ge=0, le=MAX_LENGTH)]
Key = Annotated[str, Meta(min_length=1, max_length=256)]
OpenUnit = Annotated[float, Meta(gt=0, lt=1)]  # a number in (0, 1)
Milliseconds = Annotated[float, Meta(gt=0)]
PromptText = Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]


class Slo(Struct, kw_only=True, forbid_unknown_fields=True):
    """The request's latency objectives; carried for the allocation path, no predictor reads them yet."""

    ttft_ms: Milliseconds | None = None
    tbt_ms: Milliseconds | None = None


class PredictRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/predict`: one request's prompt (text or token ids, exactly one), its cap and its keys.
    `true_length` is for benchmarks only: what the `oracle` predictor answers."""

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_LENGTH)]
    prompt: PromptText | None = None
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    tenant: Key = "default"
    template: Key | None = None
    slo: Slo | None = None
    true_length: Length | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give the prompt as exactly one of `prompt` (text) and `prompt_token_ids`")
        if not (self.prompt or self.prompt_token_ids):
            raise ValueError("the prompt is empty")


class PredictedLength(Struct, kw_only=True, frozen=True):
    """The prediction: `estimated` (what to allocate for) is `predicted` moved by `padding` in
    `direction`; `confidence` is the c_i behind the padding (None for a fixed-padding predictor)."""

    predicted: int
    direction: str
    padding: float
    estimated: int
    confidence: float | None
    predictor: str


class ObserveRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/observe`: a finished request's actual output length, under the keys it was predicted
    with; `predicted` and `estimated` (from its prediction) feed the error and provisioning metrics.
    `prompt` (the prompt text) is what the `embedding` predictor learns from; `prompt_len` is accepted
    for predictors that learn from it, which no built-in one does."""

    actual: Length
    tenant: Key = "default"
    template: Key | None = None
    prompt: PromptText | None = None
    prompt_len: Length | None = None
    predicted: Length | None = None
    estimated: Length | None = None

    def __post_init__(self) -> None:
        if self.prompt == "":
            raise ValueError("the prompt is empty")


class ConfigChange(Struct, kw_only=True, forbid_unknown_fields=True):
    """`PUT /v1/config`: the fields to change; those left out keep their value."""

    predictor: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    alpha: OpenUnit | None = None
    beta: Annotated[float, Meta(gt=0)] | None = None
    confidence: OpenUnit | None = None
    adaptive: bool | None = None

    def __post_init__(self) -> None:
        if self.beta is not None and not math.isfinite(self.beta):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta}")


class PredictorSettings(Struct, kw_only=True, frozen=True):
    """`GET /v1/config`: the settings in force, the predictors to choose from, and the arrival rate
    (requests/s) measured now. With `adaptive`, c = alpha / (1 + beta * arrival_rate) (CacheOpt Eq. 4);
    without, c = `confidence`."""

    predictor: str
    alpha: float
    beta: float
    confidence: float
    adaptive: bool
    rate_window_s: float
    arrival_rate: float
    available: list[str] = field(default_factory=list)
