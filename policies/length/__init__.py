"""Output-length prediction and confidence padding (CacheOpt 3.2): pure functions and small in-memory
predictors, no I/O. `padding` holds Eq. 2-4, `predictors` the LengthPredictor contract with the
baselines (history, RLP, S3, oracle), `arrival_rate` the measured lambda Eq. 4 reads, `embedding`
CacheOpt's learned predictor (Fig. 10; it needs torch, so it is not imported here), `registry` finds
predictors by name."""

from .padding import Direction, adaptive_confidence, confidence_padding, padded_length
from .predictors import LengthPredictor, LengthQuery, Prediction

__all__ = ["Direction", "LengthPredictor", "LengthQuery", "Prediction", "adaptive_confidence",
           "confidence_padding", "padded_length"]
