"""Confidence-based padding (CacheOpt 3.2): how far to move a predicted output length so that the
request's KV demand is met with a chosen confidence, and how that confidence follows the arrival rate.

The predicted output length is the predictor's raw number; the estimated output length is that number
moved by the padding in the predicted deviation direction (CacheOpt's own terms, section 2.1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import numpy as np

# CacheOpt section 5: confidence 90% and beta = 100. Section 5 also prints alpha = 8, which breaks
# Eq. 4's own bound 0 < alpha <= 1 (c would exceed 1); Fig. 17f's alpha = 0.9 matches the 90%.
DEFAULT_CONFIDENCE = 0.9
DEFAULT_ALPHA = 0.9
DEFAULT_BETA = 100.0
# Eq. 4 reads lambda in requests per millisecond. The paper does not name the unit; in requests per
# second, beta = 100 would give c = 3e-4 at its own ShareGPT rate (28 req/s), so padding would vanish
# at every rate it measures and Fig. 17f's beta sweep could change nothing. Per millisecond, c = 0.82
# at 1 req/s, 0.24 at 28 and 0.18 at 40: the range section 5 and Fig. 17 discuss.
RATE_PER_MS = 1e-3


class Direction(StrEnum):
    """Which way the prediction is expected to miss the actual length."""

    OVER = "over"    # predicted > actual: the padding is subtracted
    UNDER = "under"  # predicted < actual: the padding is added


def confidence_padding(confidence: float, error_range: float) -> float:
    """Padding t_i in tokens, CacheOpt Eq. 3: t_i = sqrt(-(b_i - a_i)^2 / 2 * ln(1 - c_i)).

    Eq. 3 solves Eq. 2, P(X_i - X^_i >= t_i) <= exp(-2 t_i^2 / (b_i - a_i)^2), for the bound
    exp(...) = 1 - c_i. Eq. 2 is Hoeffding's Eq. 1 with n = 1: one random variable, the request's own
    output length X_i, so no 1/n enters and the padding does not shrink with the number of past
    observations. `error_range` is (b_i - a_i), the range of the predictor's lengths for this request.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in the open interval (0, 1), got {confidence}")
    if not math.isfinite(error_range) or error_range < 0:
        raise ValueError(f"error range b - a must be a finite number >= 0 (b < a is an empty range), got {error_range}")
    return math.sqrt(-(error_range ** 2) / 2 * math.log(1 - confidence))


def error_interval(errors: Sequence[float], coverage: float) -> tuple[float, float]:
    """Eq. 3's (a_i, b_i) from a predictor's measured errors: the signed errors (actual - predicted) of
    its predictions on held-out requests, cut at their (1 - coverage) / 2 and (1 + coverage) / 2
    quantiles, so a `coverage` share of them lies in [a, b] and the tails are cut equally. Quantiles
    interpolate linearly between the sorted errors (numpy's and torch's default)."""
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must be in the open interval (0, 1), got {coverage}")
    values = np.asarray(errors, dtype=float)
    if not values.size or not np.isfinite(values).all():
        raise ValueError("need at least one error, every one finite")
    tail = (1 - coverage) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return float(low), float(high)


def padded_length(predicted: int, padding: float, direction: Direction, max_tokens: int) -> int:
    """The estimated output length: `padding` added to an under-prediction or subtracted from an
    over-prediction, then clamped to [1, max_tokens]. Rounds up, toward more KV, the safe side."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    signed = padding if direction is Direction.UNDER else -padding
    return min(max(math.ceil(predicted + signed), 1), max_tokens)


def adaptive_confidence(arrival_rate: float, alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA) -> float:
    """Confidence c_i for an arrival rate given in requests per second, CacheOpt Eq. 4:
    c_i = alpha / (1 + beta * lambda) with lambda that rate in requests per millisecond (RATE_PER_MS),
    alpha the confidence at lambda -> 0 and beta > 0 how fast it falls as the rate rises (a higher
    rate wants less padding, hence less confidence).

    The paper allows 0 < alpha <= 1; alpha = 1 is refused here because at lambda = 0 it gives c = 1,
    for which Eq. 3 has no finite padding."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in the open interval (0, 1), got {alpha}")
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta}")
    if not (math.isfinite(arrival_rate) and arrival_rate >= 0):
        raise ValueError(f"arrival rate must be a finite number >= 0 requests/s, got {arrival_rate}")
    return alpha / (1 + beta * arrival_rate * RATE_PER_MS)


def predicted_range(predicted: int, padding: float, max_tokens: int) -> tuple[int, int]:
    """The lower bound and the median of a request's output length that the engines are told beside the
    estimate: the prediction minus its padding, and the prediction, each within [1, max_tokens] (LayerKV
    reads the lower bound for the tokens still to come, the median for when the request ends)."""
    median = max(1, min(predicted, max_tokens))
    return max(1, min(median, int(predicted - padding))), median
