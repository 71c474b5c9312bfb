"""CacheOpt's requests for the simulator: Table 1's length shapes, a length predictor's error model,
and the output length each compared method allots for (its estimated length).

Shapes. Table 1 gives each trace's mean, min and max lengths over its N requests, not a distribution.
A length is log-normal of the table's mean, its log's standard deviation the larger of the two that
put the expected extremes of N draws at the table's max and min (z = the N-th quantile of a normal:
ln(max / mean) = z sigma - sigma^2 / 2, ln(mean / min) = z sigma + sigma^2 / 2), then clipped to
[min, max]: the wider one of the two, so both ends are reached, the clip keeping the other.

Predictor. CacheOpt's own predictor (a fine-tuned OPT-13B, Fig. 10) is not published beyond Fig. 17h;
RLP reports 67% accuracy and S^3 79% (section 3.2). The model here: the predicted length is the actual
one times exp(e), e ~ N(0, log_sigma), at least 1; the deviation direction (Fig. 10's classifier) is
the true one with probability direction_accuracy. Every method reads the same predicted lengths (as
the paper's RLP and S^3 run its own fine-tuned model), and differs in the padding:

- cacheopt: Eq. 3's padding at Eq. 4's confidence for the arrival rate (policies/length/padding.py),
  alpha and beta as `Confidence` holds them (section 5's 0.9 and 100, Fig. 17e-f varies them), or at a
  fixed confidence in their place (Fig. 17g's "confidence score"), with (a, b) from the predictor's
  measured errors (`error_interval`): its signed errors actual - predicted, in tokens, on held-out
  requests of the trace, their central 90% (section 5's confidence), added or subtracted by the
  direction;
- cka (CacheOpt /CKA): a fixed padding of 10% of the prediction, added;
- rlp: the prediction plus 100 tokens (RLP_PADDING);
- s3: the upper bound of its 50-token bucket (S3_BUCKET);
- none (vLLM): no estimate.
Each is capped at the request's max_tokens as the policies see it (the trace's longest output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kvmesh.policies.length.padding import (DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_CONFIDENCE, Direction,
                                             adaptive_confidence, confidence_padding, error_interval, padded_length)
from kvmesh.policies.length.predictors import RLP_PADDING, S3_BUCKET, s3_bucket_upper_bound

RULES = ("none", "cacheopt", "cka", "rlp", "s3")
HELD_OUT = 1000      # held-out requests a predictor's errors are measured on
CKA_PADDING = 0.1    # /CKA: "a fixed padding of 10% of the predicted output length" (section 5.2)


@dataclass(frozen=True, slots=True)
class Shape:
    """One column of Table 1: mean, min and max over `count` requests."""

    mean: float
    low: int
    high: int
    count: int

    @property
    def sigma(self) -> float:
        """The log-normal sigma that reaches the farther of the two extremes (see the module's doc)."""
        z = NormalDist().inv_cdf(1 - 1 / self.count)
        from_max = z - math.sqrt(max(0.0, z * z - 2 * math.log(self.high / self.mean)))
        from_min = -z + math.sqrt(z * z + 2 * math.log(self.mean / self.low))
        return max(from_max, from_min)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        sigma = self.sigma
        drawn = rng.lognormal(math.log(self.mean) - sigma ** 2 / 2, sigma, n)
        return np.clip(np.rint(drawn), self.low, self.high).astype(int)


@dataclass(frozen=True, slots=True)
class PredictorModel:
    log_sigma: float = 0.5             # the raw prediction's log error, N(0, log_sigma)
    direction_accuracy: float = 0.75   # how often the classifier names the way the prediction misses

    def predict(self, rng: np.random.Generator, actual: np.ndarray) -> tuple[np.ndarray, list[Direction]]:
        """Each request's predicted length and direction."""
        predicted = np.maximum(1, np.rint(actual * np.exp(rng.normal(0.0, self.log_sigma, len(actual))))).astype(int)
        right = rng.random(len(actual)) < self.direction_accuracy
        truth = [Direction.UNDER if a > p else Direction.OVER for a, p in zip(actual, predicted)]
        flipped = {Direction.UNDER: Direction.OVER, Direction.OVER: Direction.UNDER}
        return predicted, [d if ok else flipped[d] for d, ok in zip(truth, right)]

    def error_interval(self, rng: np.random.Generator, held_out: np.ndarray) -> tuple[float, float]:
        """Eq. 3's (a, b) in tokens: this predictor's errors (actual - predicted) on held-out requests of
        lengths `held_out`, their central DEFAULT_CONFIDENCE (section 5's 90%)."""
        predicted, _ = self.predict(rng, held_out)
        return error_interval((held_out - predicted).tolist(), DEFAULT_CONFIDENCE)


@dataclass(frozen=True, slots=True)
class Confidence:
    """CacheOpt's confidence c_i: Eq. 4's alpha / (1 + beta lambda) at the arrival rate, or `fixed`
    whatever the rate (Fig. 17g sweeps a confidence score, not Eq. 4's parameters)."""

    alpha: float = DEFAULT_ALPHA
    beta: float = DEFAULT_BETA
    fixed: float | None = None

    def at(self, rate: float) -> float:
        """c_i at an arrival rate in req/s."""
        return self.fixed if self.fixed is not None else adaptive_confidence(rate, self.alpha, self.beta)


def estimated(rule: str, predicted: np.ndarray, directions: list[Direction], max_tokens: list[int], rate: float,
              interval: tuple[float, float], confidence: Confidence = Confidence()) -> list[int | None]:
    """Each request's estimated output length under a method's `rule` (RULES), at most its max_tokens,
    at an arrival rate in req/s; CacheOpt's pads by Eq. 3 for the predictor's error `interval` (a, b)
    at its `confidence` at that rate (the other rules read neither)."""
    each = list(zip(predicted.tolist(), directions, max_tokens))
    if rule == "none":
        return [None] * len(each)
    if rule == "cacheopt":
        padding = confidence_padding(confidence.at(rate), interval[1] - interval[0])
        return [padded_length(p, padding, d, cap) for p, d, cap in each]
    if rule == "cka":
        return [padded_length(p, CKA_PADDING * p, Direction.UNDER, cap) for p, _, cap in each]
    if rule == "rlp":
        return [padded_length(p, RLP_PADDING, Direction.UNDER, cap) for p, _, cap in each]
    if rule == "s3":
        return [min(s3_bucket_upper_bound(p, S3_BUCKET), cap) for p, _, cap in each]
    raise ValueError(f"unknown estimate rule {rule!r}; rules: {', '.join(RULES)}")
