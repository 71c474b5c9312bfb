"""The arrival rate lambda that CacheOpt Eq. 4 reads, measured from the arrivals: the predictor
service's `/v1/predict` calls, or the simulator's front door's arrivals (sim/front_door.py).

An exponentially weighted rate: each arrival counts with weight exp(-age / window), and the estimate
is that weighted count divided by `window` (seconds), in requests per second. So one arrival adds
1 / window at once and the estimate decays by a factor e every `window` seconds without arrivals; under
a steady rate lambda it reads lambda on average over time. Pure functions: time is an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArrivalRate:
    """The estimate `rate` (requests/s) as it stood at time `at` (seconds, any monotonic clock)."""

    rate: float = 0.0
    at: float = 0.0


def rate_at(estimate: ArrivalRate, now: float, window_s: float) -> float:
    """The estimate at `now`, decayed since its last arrival (a clock that steps back counts as no time)."""
    _check_window(window_s)
    return estimate.rate * math.exp(-max(now - estimate.at, 0.0) / window_s)


def arrive(estimate: ArrivalRate, now: float, window_s: float) -> ArrivalRate:
    """The estimate after one arrival at `now`: decayed to `now`, plus 1 / window."""
    return ArrivalRate(rate_at(estimate, now, window_s) + 1 / window_s, max(now, estimate.at))


def _check_window(window_s: float) -> None:
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"the rate window must be a finite number of seconds > 0, got {window_s}")
