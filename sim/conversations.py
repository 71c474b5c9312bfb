"""Multi-turn conversations, the workload of KV reuse (CaR): each conversation opens with a context of
`history` tokens (earlier chat, a document, a system prompt), and each later turn's prompt is the
conversation so far (every earlier prompt and answer) and a new user message. A request names its
full blocks by conversation and block index (SimRequest.block_names), so turn k+1's names extend turn
k's as its tokens do, and the prefix cache (prefix_count.py) finds them.

Conversations start as a Poisson process; a turn arrives a think time (exponential) after the one
before it arrived, whether or not that one has finished (the arrivals are fixed before the run), so
a turn that comes early finds only what was cached by then. A conversation ends at `turns` turns or
at the context window, whichever comes first."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .request import SimRequest
from .workload import Lengths


@dataclass(frozen=True, slots=True)
class Conversations:
    rate: float              # conversations started per second
    turns: int               # turns of each conversation, at most
    history: int             # tokens its first turn's prompt opens with
    message: Lengths         # a later turn's new tokens
    output: Lengths          # every turn's answer
    think_s: float           # mean time from one turn's arrival to the next's
    max_context: int         # prompt and answer together at most (the model's context window)


def conversations(shape: Conversations, n: int, block_size: int, seed: int) -> list[SimRequest]:
    """`n` requests (the last conversation may be cut short), in arrival order; request `c{i}t{k}` is
    conversation i's turn k."""
    if shape.rate <= 0 or shape.turns < 1 or n < 1 or shape.history + 1 >= shape.max_context:
        raise ValueError(f"conversations need rate > 0, turns >= 1, n >= 1 and a history below the context "
                         f"window; got {shape.rate}, {shape.turns}, {n}, {shape.history} of {shape.max_context}")
    rng = np.random.default_rng(seed)
    requests: list[SimRequest] = []
    start = 0.0
    for i in range(n):
        start += rng.exponential(1 / shape.rate)
        arrival, context = start, 0
        for k in range(shape.turns):
            prompt = context + (shape.history if k == 0 else shape.message.draw(rng, 1)[0])
            output = min(shape.output.draw(rng, 1)[0], shape.max_context - prompt)
            if output < 1 or len(requests) == n:
                break
            names = tuple(f"c{i}:{j}" for j in range((prompt + output) // block_size))
            requests.append(SimRequest(f"c{i}t{k}", arrival, prompt, output, block_names=names))
            context = prompt + output
            arrival += rng.exponential(shape.think_s)
        if len(requests) == n:
            break
    return sorted(requests, key=lambda r: r.arrival)


def turn(request: SimRequest) -> int:
    """The turn a conversation's request is (0: its first, with no history of its own cached)."""
    return int(request.request_id.rpartition("t")[2])
