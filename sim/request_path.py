"""The request's path outside the engine, as measured terms of a profile: what a client sees of a
request is the engine's timeline plus these. The engine's own timings of each request (admission's
`timings_ms`: queue, prefill, decode on the engine) held against the client's give them:

  first_token_s    client's TTFT - the engine's arrival-to-first-token: the client's send to the
                   engine's arrival (admission, tokenization, routing, HTTP) and the first token's way
                   back (frame stream, admission, SSE);
  last_token_lag_s (client's last answer - its first token) - the engine's first-to-last token: how
                   much longer the last token's way out takes than the first's;
  last_token_lag_per_request_s  how much that lag grows with each other request in flight at the
                   request's first token (a split request's hop through the admission to its decode
                   engine, and its wait there, grow with the load): the lag is fitted as
                   last_token_lag_s + this x the requests in flight, least squares over the requests.

Only their sum before the first token is measured, not the send and the way back apart; a constant
delay before the engine shifts every arrival alike and leaves the engine's schedule as it is, so the
simulator adds both after it (`delivered`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .request import SimRequest
from .step_cost import profile_path

TERMS = ("first_token_s", "last_token_lag_s", "last_token_lag_per_request_s")


@dataclass(frozen=True, slots=True)
class RequestPath:
    first_token_s: float = 0.0
    last_token_lag_s: float = 0.0
    last_token_lag_per_request_s: float = 0.0


def measure(ttft_s: Sequence[float], e2e_s: Sequence[float], engine_first_token_s: Sequence[float],
            engine_decode_s: Sequence[float], in_flight: Sequence[int] | None = None) -> RequestPath:
    """The client's figures minus the engine's (one entry per request): the mean before the first
    token; after it, the mean, or with `in_flight` (the other requests in flight at each one's first
    token) the least-squares line through the lags against it, its slope held at 0 if negative."""
    ttft, e2e = np.asarray(ttft_s, dtype=float), np.asarray(e2e_s, dtype=float)
    if not len(ttft):
        raise ValueError("no request to measure the path outside the engine on")
    lag = e2e - ttft - np.asarray(engine_decode_s, dtype=float)
    first = float(np.mean(ttft - np.asarray(engine_first_token_s, dtype=float)))
    n = np.asarray(in_flight if in_flight is not None else np.zeros(len(lag)), dtype=float)
    slope = max(float(np.polyfit(n, lag, 1)[0]), 0.0) if np.ptp(n) > 0 else 0.0
    return RequestPath(first_token_s=first, last_token_lag_s=float(np.mean(lag - slope * n)),
                       last_token_lag_per_request_s=slope)


def requests_in_flight(arrivals: Sequence[float], first_tokens: Sequence[float], ends: Sequence[float]) -> list[int]:
    """For each request, the other requests in flight (arrived, not ended) at its first token."""
    arrived, ended = np.sort(np.asarray(arrivals, dtype=float)), np.sort(np.asarray(ends, dtype=float))
    at = np.asarray(first_tokens, dtype=float)
    counts = np.searchsorted(arrived, at, side="right") - np.searchsorted(ended, at, side="right")
    return [int(c) - 1 for c in counts]  # itself is in flight at its own first token


def delivered(requests: Sequence[SimRequest], path: RequestPath) -> None:
    """Move the simulated requests' tokens to when the client has them: the first `first_token_s`
    after its sampling, the later ones and the end the lag later still (`last_token_lag_s`, and
    `last_token_lag_per_request_s` for each other request in flight at its first token, counted in
    the simulated timeline among the requests that finished)."""
    per = path.last_token_lag_per_request_s
    done = [r for r in requests if r.finished_at is not None and r.token_times]
    flying = dict(zip(map(id, done), requests_in_flight([r.arrival for r in done], [r.token_times[0] for r in done],
                                                       [r.finished_at for r in done]))) if per else {}
    for r in requests:
        later = path.first_token_s + path.last_token_lag_s + per * flying.get(id(r), 0)
        if r.token_times:
            r.token_times = [r.token_times[0] + path.first_token_s, *(t + later for t in r.token_times[1:])]
        if r.finished_at is not None:
            r.finished_at += later


def profile_entry(path: RequestPath, origin: str) -> dict:
    """The terms as a profile holds them (step_cost.write_profile's `about["request_path"]`)."""
    return {term: {"value": value, "origin": origin} for term, value in asdict(path).items()}


def load_request_path(name: str) -> RequestPath:
    """A profile's request path; none (zero terms) in a profile of the engine's steps alone."""
    entry = json.loads(profile_path(name).read_text()).get("request_path", {})
    return RequestPath(**{term: float(entry[term]["value"]) for term in TERMS if term in entry})
