"""The request's path outside the engine, as two measured terms of a profile: what a client sees of
a request is the engine's timeline plus these. The engine's own timings of each request (admission's
`timings_ms`: queue, prefill, decode on the engine) held against the client's give them:

  first_token_s    client's TTFT - the engine's arrival-to-first-token: the client's send to the
                   engine's arrival (admission, tokenization, routing, HTTP) and the first token's way
                   back (frame stream, admission, SSE);
  last_token_lag_s (client's last answer - its first token) - the engine's first-to-last token: how
                   much longer the last token's way out takes than the first's.

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

TERMS = ("first_token_s", "last_token_lag_s")


@dataclass(frozen=True, slots=True)
class RequestPath:
    first_token_s: float = 0.0
    last_token_lag_s: float = 0.0


def measure(ttft_s: Sequence[float], e2e_s: Sequence[float], engine_first_token_s: Sequence[float],
            engine_decode_s: Sequence[float]) -> RequestPath:
    """The means over requests of the client's figures minus the engine's (one entry per request)."""
    ttft, e2e = np.asarray(ttft_s, dtype=float), np.asarray(e2e_s, dtype=float)
    if not len(ttft):
        raise ValueError("no request to measure the path outside the engine on")
    return RequestPath(first_token_s=float(np.mean(ttft - np.asarray(engine_first_token_s, dtype=float))),
                       last_token_lag_s=float(np.mean(e2e - ttft - np.asarray(engine_decode_s, dtype=float))))


def delivered(requests: Sequence[SimRequest], path: RequestPath) -> None:
    """Move the simulated requests' tokens to when the client has them: the first `first_token_s`
    after its sampling, the later ones and the end `last_token_lag_s` later still."""
    later = path.first_token_s + path.last_token_lag_s
    for r in requests:
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
