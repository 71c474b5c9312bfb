"""Replays one trace through a real in-process engine: the `tiny` model computes every step, the
engine's scheduler, allocation ledger and preemption run as in service, and the clock is real except
that idle time before the next arrival is skipped (so a run takes its compute time, not its trace's
duration). A request ends at its trace length, as if it sampled EOS there; its max_tokens is the
trace's longest output, so no policy can read its true length from it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.services.engine.native.engine import Engine
from kvmesh.services.engine.native.request import Request
from kvmesh.services.engine.steps import StepLog

from .instruction_trace import TraceRequest


class SkippingClock:
    """time.perf_counter, moved forward past idle gaps."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.offset

    def skip_to(self, at: float) -> None:
        self.offset += max(0.0, at - self())


@dataclass(frozen=True)
class Served:
    arrival: float
    times: list[float]          # each output token's time, engine clock
    preemptions: int

    @property
    def ttft(self) -> float:
        return self.times[0] - self.arrival

    @property
    def gaps(self) -> np.ndarray:
        return np.diff(self.times)

    @property
    def normalised_latency(self) -> float:
        """End-to-end latency over output length (Orca, vLLM, CacheOpt Fig. 12e)."""
        return (self.times[-1] - self.arrival) / len(self.times)


@dataclass(frozen=True)
class RunStats:
    served: list[Served]
    preemptions: dict[str, int]
    busy_s: float    # the run's real seconds: the engine busy, the idle gaps skipped before arrivals not counted
    # What the run was given and what its steps took, for the simulator to replay it (bench/sim_cacheopt.py);
    # empty for a run on stock vLLM (bench vllm_cacheopt), which the simulator does not replay.
    arrivals: list[float] = field(default_factory=list)   # seconds from the start
    targets: list[Targets] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)       # each stepping turn of the loop, as GET /v1/steps lists them


def replay(engine: Engine, requests: list[TraceRequest], arrivals: np.ndarray, targets: list[Targets],
           max_tokens: int, advance: Callable[[], None] = lambda: None) -> RunStats:
    """Serve `requests` arriving at `arrivals` (seconds from the start); `advance` is called per request done."""
    clock = SkippingClock()
    engine.clock = clock
    start = clock()
    before = dict(engine.preemptions)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    live: dict[str, tuple[int, Request]] = {}
    served: dict[int, Served] = {}
    steps = StepLog(capacity=None)
    nxt = 0
    while nxt < len(requests) or live:
        if not engine.scheduler.has_work() and nxt < len(requests):
            clock.skip_to(start + arrivals[nxt])
        turn, stepped = time.perf_counter(), engine.steps
        while nxt < len(requests) and start + arrivals[nxt] <= clock():
            request = requests[nxt]
            live[str(nxt)] = (nxt, engine.add(str(nxt), request.prompt_ids, params, arrival=start + arrivals[nxt],
                                              targets=targets[nxt]))
            nxt += 1
        engine.step()
        for request_id, (index, request) in list(live.items()):
            if len(request.output_ids) >= requests[index].output_len:
                if not request.finished:
                    engine.abort(request_id, "stop")
                served[index] = Served(request.arrival, list(request.output_times), request.preemptions)
                del live[request_id]
                advance()
        if engine.steps != stepped:  # the turn's time, as the engine service's loop records its own
            steps.record(engine.steps, float(clock()), time.perf_counter() - turn, engine.last_shape,
                         engine.last_staged_bytes)
    return RunStats([served[i] for i in range(len(requests))],
                    {k: v - before.get(k, 0) for k, v in engine.preemptions.items()}, clock() - start - clock.offset,
                    [float(a) for a in arrivals], list(targets), msgspec.to_builtins(steps.read().steps))


def capacity(engine: Engine, requests: list[TraceRequest], targets: list[Targets], max_tokens: int, repeats: int,
             advance: Callable[[], None] = lambda: None) -> float:
    """Requests per second `engine` completes with every request there at once: the best of
    `repeats` runs, since anything else on the machine only ever lowers it (and with it every rate a
    benchmark derives from it)."""
    best = 0.0
    for _ in range(repeats):
        stats = replay(engine, requests, np.zeros(len(requests)), targets, max_tokens, advance)
        best = max(best, len(requests) / max(s.times[-1] - s.arrival for s in stats.served))
    return float(best)
