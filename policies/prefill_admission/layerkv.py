"""LayerKV's SLO-aware prefill admission (3.1, Eq. 1-3, Algorithm 1).

A decoding request with a TPOT SLO allows prefills to run for as long as its remaining TPOT budget
permits (Eq. 1); queued prefills are admitted, first come first served, while their estimated
prefill times (Eq. 3) sum to less than the smallest allowance (Eq. 2).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvmesh.policies.costs import PrefillCost
from kvmesh.policies.views import PoolView, RequestView


def prefill_time_s(seqlen: int, cost: PrefillCost) -> float:
    """Eq. 3."""
    return cost.alpha * seqlen * (2 * cost.num_params + 2 * seqlen * cost.hidden_size) / cost.flops_per_s


def allowed_prefill_s(tpot_slo_s: float, n_past: int, n_future: int, t_past_s: float, t_future_s: float) -> float:
    """Eq. 1: T_allow = T_tpot (N_past + N_future) - (T_past + T_future)."""
    return tpot_slo_s * (n_past + n_future) - (t_past_s + t_future_s)


def future_tokens(n_past: int, predicted_low: int | None) -> int:
    """N_future: the predicted range's lower bound less the tokens already decoded, at least 1 (the
    paper constrains it to positive integers); 1 without a prediction, the most conservative."""
    return 1 if predicted_low is None else max(1, predicted_low - n_past)


def max_prefills(prefill_times_s: Sequence[float], min_allowance_s: float) -> int:
    """Algorithm 1: the most leading prefills whose times sum to strictly less than the allowance (Eq. 2)."""
    total, n = 0.0, 0
    for t in prefill_times_s:
        total += t
        if not total < min_allowance_s:
            break
        n += 1
    return n


def allowance_s(request: RequestView, now: float, decode_s: float | None = None) -> float | None:
    """Eq. 1 for one running request; None when it is not decoding or has no TPOT SLO.

    Decoding starts with the first token, so N_past counts the tokens after it and T_past the time
    since it (the wait for decode steps included, and a wait for its offloaded layers to come back).
    T_future is the current TPOT times N_future; the current TPOT is the time its latest token took,
    or the time it has waited for the next when that is longer, not T_past / N_past. The average
    would make Eq. 1 (TPOT_slo - average) (N_past + N_future), whose sign no prediction could change:
    one prefill that stalled a young request would hold every other until the request's average
    recovered. Read as the rate decoding goes at now, N_future spreads the stall over the tokens
    still to come, as the paper's prediction is there to.

    Before a second token the request has no rate of its own: it is taken to be `decode_s`, the
    rate the engine's decodes go at now (the running requests' latest token times), and the SLO
    when none has one. (Taking the SLO always made the allowance -T_past from the first token on:
    every new first token held every prefill, and a prefilled request waiting for its layers to come
    back, which has no second token for as long as it waits, held the queue for its whole wait though
    its TPOT budget had room for it: docs/layerkv.md.)"""
    if request.first_token_at is None or request.tbt_slo_ms is None:
        return None
    slo = request.tbt_slo_ms / 1e3
    n_past = max(0, request.num_generated - 1)
    t_past = max(0.0, now - request.first_token_at)
    n_future = future_tokens(n_past, request.predicted_output_low)
    if request.last_token_gap_s is None or request.last_token_at is None:
        tpot = slo if decode_s is None else decode_s
    else:
        tpot = max(request.last_token_gap_s, now - request.last_token_at)
    return allowed_prefill_s(slo, n_past, n_future, t_past, tpot * n_future)


def layerkv(waiting: Sequence[RequestView], running: Sequence[RequestView], pool: PoolView, now: float) -> list[str]:
    """The prefill_admission hook: FCFS, cut to as many prefills as Algorithm 1 allows. With no
    decoding request that has a TPOT SLO, or no profiled prefill cost, every waiting request.

    Where the paper is silent: T_prefill is Eq. 3 (Algorithm 1's line 4 says Eq. 4, a slip) for the
    tokens still to compute, seqlen = num_tokens - num_computed; a decoding request already behind
    its SLO has a negative allowance and holds every prefill until it finishes (Eq. 2 as written)."""
    order = sorted(waiting, key=lambda r: r.arrival)
    gaps = [r.last_token_gap_s for r in running if r.last_token_gap_s is not None]
    decode_s = statistics.median(gaps) if gaps else None
    allowances = [a for a in (allowance_s(r, now, decode_s) for r in running) if a is not None]
    if not allowances or pool.prefill_cost is None:
        return [r.request_id for r in order]
    times = [prefill_time_s(r.uncomputed_tokens, pool.prefill_cost) for r in order]
    return [r.request_id for r in order[:max_prefills(times, min(allowances))]]
