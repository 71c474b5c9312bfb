"""The planner's requests (sim/plan_search.py): one seed's lengths and arrivals, each request carrying
the planner's SLOs, and the output length its KV allocation policy allots for.

Predictions. The allocation policies other than block at a time read a predicted output length. The
planner has no predictor of its own: it gives each request its real output length blurred by
CacheOpt's error model (sim/papers/predicted_lengths.py: the length times exp(e), e ~ N(0, 0.5), the
deviation's direction right 75% of the time), padded as the policy's paper pads it, and capped at the
workload's longest output (every request's max_tokens as the policies see it). The predictions draw
from their own generator, so every allocation runs on the same lengths and arrivals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .conversations import Conversations, conversation_turns
from .papers.predicted_lengths import PredictorModel, estimated
from .request import SimRequest
from .workload import Lengths, poisson

PREDICTOR = PredictorModel()
# Each kv_allocation policy's estimate rule (predicted_lengths.RULES); another package's policy gets
# CacheOpt's padded prediction.
ESTIMATE_RULES = {"block_at_a_time": "none", "estimate": "rlp", "rlp": "rlp", "s3": "s3", "cacheopt": "cacheopt",
                  "cacheopt_guarded": "cacheopt"}


def estimate_rule(allocation: str) -> str:
    return ESTIMATE_RULES.get(allocation, "cacheopt")


def planned_requests(rate: float, n: int, prompt: Lengths, output: Lengths, seed: int, slos: dict[str, float],
                     allocation: str) -> list[SimRequest]:
    """`poisson`'s requests with the SLOs a request states (ttft; tpot as its TBT SLO, which CacheOpt's
    allocation reads) and the estimated output length of `allocation`'s rule."""
    workload = poisson(rate, n, prompt, output, seed)
    _state(workload, rate, seed, slos, allocation)
    return workload


def planned_turns(rate: float, n: int, shape: Conversations, block_size: int, seed: int, slos: dict[str, float],
                  allocation: str) -> list[list[tuple[SimRequest, float]]]:
    """`n` turns of conversations started at `rate` a second, by conversation (conversation_turns), each
    turn stating what `planned_requests`' requests do."""
    talks = conversation_turns(replace(shape, rate=rate), n, block_size, seed)
    _state([request for talk in talks for request, _ in talk], rate, seed, slos, allocation)
    return talks


def _state(workload: list[SimRequest], rate: float, seed: int, slos: dict[str, float], allocation: str) -> None:
    rule = estimate_rule(allocation)
    n = len(workload)
    if rule != "none":
        actual = np.array([r.max_tokens for r in workload])
        predicted, directions = PREDICTOR.predict(np.random.default_rng([seed, 1]), actual)
        interval = PREDICTOR.error_interval(np.random.default_rng([seed, 2]), actual)  # fresh predictions of them
        cap = int(actual.max())
        for request, estimate in zip(workload, estimated(rule, predicted, directions, [cap] * n, rate, interval)):
            request.predicted_output_len = estimate
    for request in workload:
        request.ttft_slo_ms = slos["ttft"] * 1e3 if "ttft" in slos else None
        request.tbt_slo_ms = slos["tpot"] * 1e3 if "tpot" in slos else None
