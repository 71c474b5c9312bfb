"""Output-length predictors: the `LengthPredictor` contract and the baselines CacheOpt compares with.

A predictor turns one request into a `Prediction` (predicted length, deviation direction, padding,
estimated length, confidence) and learns from the actual length when the request ends. All of them
are in-memory and bounded; none does I/O. The learned `embedding` predictor (CacheOpt 3.2, Fig. 10)
is in embedding.py.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from statistics import fmean
from typing import Protocol

from .padding import DEFAULT_CONFIDENCE, Direction, confidence_padding, padded_length

RLP_PADDING = 100  # tokens, CacheOpt 5 after [7]
S3_BUCKET = 50     # tokens per length bucket, CacheOpt 5 after [8]


@dataclass(frozen=True, slots=True)
class LengthQuery:
    """What a predictor sees of one request."""

    tenant: str
    max_tokens: int
    prompt_ids: tuple[int, ...] = ()
    text: str | None = None
    template: str | None = None      # prompt template id, when the caller knows one
    true_length: int | None = None   # benchmarks only: what `oracle` returns

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def key(self) -> str:
        """What history is kept under: the prompt template when known, else the tenant."""
        return self.template if self.template is not None else self.tenant


@dataclass(frozen=True, slots=True)
class Prediction:
    predicted: int            # the predictor's own output length
    direction: Direction      # which way `predicted` is expected to miss
    padding: float            # tokens moved in `direction` (CacheOpt Eq. 3, or a baseline's fixed rule)
    estimated: int            # what to allocate for: predicted moved by padding, in [1, max_tokens]
    confidence: float | None  # c_i behind the padding; None when the padding is a fixed rule


class LengthPredictor(Protocol):
    def predict(self, query: LengthQuery, confidence: float = DEFAULT_CONFIDENCE) -> Prediction:
        """The prediction for `query`; `confidence` is c_i for Hoeffding padding, which the
        fixed-padding baselines ignore."""

    def observe(self, query: LengthQuery, actual: int) -> None:
        """Learn from the actual output length of a finished request."""


class HistoryPredictor:
    """Running statistics per prompt template or tenant: the mean of the last `window` lengths, its
    error range max - min as (b - a) for Hoeffding padding, and the direction the mean more often
    missed by. Memory is bounded: `window` lengths for each of at most `max_keys` keys, the least
    recently used key evicted first. A key with no history gets max_tokens, unpadded."""

    def __init__(self, window: int = 64, max_keys: int = 1024) -> None:
        if window < 1 or max_keys < 1:
            raise ValueError(f"window and max_keys must be >= 1, got {window} and {max_keys}")
        self.window = window
        self.max_keys = max_keys
        self._lengths: OrderedDict[str, deque[int]] = OrderedDict()

    def predict(self, query: LengthQuery, confidence: float = DEFAULT_CONFIDENCE) -> Prediction:
        lengths = self._lengths.get(query.key)
        if not lengths:
            no_padding = confidence_padding(confidence, 0)   # still checks the confidence
            return Prediction(query.max_tokens, Direction.UNDER, no_padding, query.max_tokens, confidence)
        self._lengths.move_to_end(query.key)
        mean = fmean(lengths)
        below = sum(n < mean for n in lengths)
        # Ties go to UNDER: an under-provisioned request is preempted, an over-provisioned one only waits.
        direction = Direction.OVER if below > len(lengths) - below else Direction.UNDER
        padding = confidence_padding(confidence, max(lengths) - min(lengths))
        predicted = round(mean)
        return Prediction(predicted, direction, padding,
                          padded_length(predicted, padding, direction, query.max_tokens), confidence)

    def observe(self, query: LengthQuery, actual: int) -> None:
        if actual < 0:
            raise ValueError(f"actual output length must be >= 0, got {actual}")
        lengths = self._lengths.setdefault(query.key, deque(maxlen=self.window))
        lengths.append(actual)
        self._lengths.move_to_end(query.key)
        if len(self._lengths) > self.max_keys:
            self._lengths.popitem(last=False)

    def error_range(self, key: str) -> int | None:
        """(b - a) for `key`: the spread of its remembered lengths, None when it has none."""
        lengths = self._lengths.get(key)
        return max(lengths) - min(lengths) if lengths else None

    def keys(self) -> list[str]:
        """Remembered keys, least recently used first."""
        return list(self._lengths)


class RLPPredictor:
    """RLP [7]: the base predictor's length plus a fixed padding (100 tokens), always added."""

    def __init__(self, base: LengthPredictor | None = None, padding: int = RLP_PADDING) -> None:
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        self.base = base if base is not None else HistoryPredictor()
        self.padding = padding

    def predict(self, query: LengthQuery, confidence: float = DEFAULT_CONFIDENCE) -> Prediction:
        predicted = self.base.predict(query, confidence).predicted
        estimated = padded_length(predicted, self.padding, Direction.UNDER, query.max_tokens)
        return Prediction(predicted, Direction.UNDER, float(self.padding), estimated, None)

    def observe(self, query: LengthQuery, actual: int) -> None:
        self.base.observe(query, actual)


class S3Predictor:
    """S3 [8]: the base predictor's length falls in a 50-token bucket and the bucket's upper bound is
    allocated; a request that outgrows it gets `s3_doubled_allocation` on its next allocation."""

    def __init__(self, base: LengthPredictor | None = None, bucket: int = S3_BUCKET) -> None:
        if bucket < 1:
            raise ValueError(f"bucket must be >= 1 token, got {bucket}")
        self.base = base if base is not None else HistoryPredictor()
        self.bucket = bucket

    def predict(self, query: LengthQuery, confidence: float = DEFAULT_CONFIDENCE) -> Prediction:
        predicted = self.base.predict(query, confidence).predicted
        upper = s3_bucket_upper_bound(predicted, self.bucket)
        estimated = min(upper, query.max_tokens)
        return Prediction(predicted, Direction.UNDER, float(upper - predicted), estimated, None)

    def observe(self, query: LengthQuery, actual: int) -> None:
        self.base.observe(query, actual)


class OraclePredictor:
    """The true length (`LengthQuery.true_length`), unpadded: the ceiling in benchmarks, never served."""

    def predict(self, query: LengthQuery, confidence: float = DEFAULT_CONFIDENCE) -> Prediction:
        if query.true_length is None:
            raise ValueError("the oracle needs the query's true_length")
        estimated = padded_length(query.true_length, 0.0, Direction.UNDER, query.max_tokens)
        return Prediction(query.true_length, Direction.UNDER, 0.0, estimated, None)

    def observe(self, query: LengthQuery, actual: int) -> None:
        """Nothing to learn."""


def s3_bucket_upper_bound(predicted: int, bucket: int = S3_BUCKET) -> int:
    """Upper bound of the bucket [k * bucket, (k + 1) * bucket) holding `predicted`."""
    if predicted < 0:
        raise ValueError(f"predicted length must be >= 0, got {predicted}")
    return (predicted // bucket + 1) * bucket


def s3_doubled_allocation(failed_allocation: int, max_tokens: int) -> int:
    """S3's next allocation after `failed_allocation` tokens ran out: twice as many, at most max_tokens."""
    if failed_allocation < 1:
        raise ValueError(f"failed allocation must be >= 1 token, got {failed_allocation}")
    return min(2 * failed_allocation, max_tokens)
