"""The simulator's front door (sim/front_door.py) and the admission and predictor services make the
same decisions on the same sequence of arrivals, first tokens and completions: each service's own
objects (admission's rate limiter, its refusal by expected wait, backlog and bounded queue, in the
order its routes call them; the predictor's /v1/predict and /v1/observe handlers), driven with a
clock of the test's, no sockets."""

from __future__ import annotations

import asyncio
import heapq
import types

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvmesh.libs.messages.predictor import ObserveRequest, PredictRequest
from kvmesh.policies.admission import Admit, AdmissionLimits
from kvmesh.policies.length.padding import predicted_range
from kvmesh.services.admission import openai_routes
from kvmesh.services.admission.limits import Backlog, BoundedQueue, QueueFull, RateLimiter
from kvmesh.services.admission.openai_api import OpenAIError
from kvmesh.services.admission.slo import Slo
from kvmesh.services.predictor import app as predictor_app
from kvmesh.sim.front_door import API_KEY, TENANT, FrontDoor, PredictorSettings
from kvmesh.sim.request import SimRequest

LIMITS = AdmissionLimits(requests_per_s=6.0, burst=4.0, max_running=3, max_queued=4, max_wait_s=1.2)


class Clock:
    now = 0.0

    def monotonic(self) -> float:
        return self.now


class ServiceDoor:
    """Admission's objects, called as its routes call them: the key's rate limit (`public`), the refusal
    by expected wait (`refuse_if_behind`), the backlog from there to the first token, the queue's slot."""

    def __init__(self, limits: AdmissionLimits, clock: Clock):
        self.clock = clock
        self.limiter = RateLimiter(limits.requests_per_s, limits.burst)
        self.backlog = Backlog()
        self.queue = BoundedQueue(limits.max_running, limits.max_queued)
        self.routes = types.SimpleNamespace(backlog=self.backlog, config=types.SimpleNamespace(
            max_wait_s=limits.max_wait_s))
        self.first_tokens: dict[str, object] = {}
        self.done: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.tasks: list[asyncio.Task] = []

    async def arrive(self, request_id: str, ttft_slo_ms: float | None) -> str:
        if self.limiter.take(API_KEY, self.clock.monotonic()):
            return "rate_limit"
        try:
            openai_routes.OpenAIRoutes.refuse_if_behind(self.routes, Slo("default", ttft_slo_ms, None))
        except OpenAIError:
            return "behind"
        outcome = asyncio.get_running_loop().create_future()
        self.tasks.append(asyncio.create_task(self._hold(request_id, outcome)))
        await _settle()
        return outcome.result() if outcome.done() else "wait"

    async def _hold(self, request_id: str, outcome: asyncio.Future) -> None:
        with self.backlog.waiting(self.clock.monotonic) as first_token:
            self.first_tokens[request_id] = first_token
            self.done[request_id] = asyncio.Event()
            try:
                async with self.queue.slot():
                    self.started.append(request_id)
                    if not outcome.done():
                        outcome.set_result("run")
                    await self.done[request_id].wait()
            except QueueFull:
                outcome.set_result("queue_full")

    async def finish(self, request_id: str) -> str | None:
        """The request ends: the one its slot went to, if any."""
        before = len(self.started)
        self.done[request_id].set()
        await _settle()
        return self.started[before] if len(self.started) > before else None


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _script(seed: int, n: int) -> list[tuple[float, float | None, float, float]]:
    """Each request: its arrival, TTFT SLO, and its first token and end after it starts."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / 9.0, n))
    slos = rng.choice([0.0, 400.0, 3000.0], n)
    first = rng.uniform(0.05, 0.6, n)
    return [(float(t), None if s == 0 else float(s), float(f), float(f + rng.uniform(0.0, 0.8)))
            for t, s, f in zip(arrivals, slos, first)]


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_the_front_door_decides_as_admission_does(monkeypatch, seed):
    clock = Clock()
    monkeypatch.setattr(openai_routes, "time", clock)
    service, door = ServiceDoor(LIMITS, clock), FrontDoor(LIMITS)
    script = _script(seed, 120)
    requests = {f"r{i}": SimRequest(f"r{i}", t, 16, 8, ttft_slo_ms=slo) for i, (t, slo, _, _) in enumerate(script)}
    events = [(t, i, "arrive", f"r{i}") for i, (t, *_) in enumerate(script)]
    heapq.heapify(events)
    seq = len(events)
    decided: list[tuple[str, str]] = []

    def start(request_id: str, now: float) -> None:
        nonlocal seq
        _, _, first, end = script[int(request_id[1:])]
        for at, kind in ((now + first, "first"), (now + end, "end")):
            heapq.heappush(events, (at, seq, kind, request_id))
            seq += 1

    while events:
        now, _, kind, request_id = heapq.heappop(events)
        clock.now = now
        if kind == "arrive":
            simulated = door.arrive(requests[request_id], now)
            simulated = simulated.value if isinstance(simulated, Admit) else simulated
            assert simulated == await service.arrive(request_id, requests[request_id].ttft_slo_ms), request_id
            decided.append((request_id, simulated))
            if simulated == "run":
                start(request_id, now)
        elif kind == "first":
            door.first_token(now)
            service.first_tokens[request_id](now)
        else:
            following = door.finished(requests[request_id])
            assert (following and following.request_id) == await service.finish(request_id), request_id
            if following is not None:
                start(following.request_id, now)
    await asyncio.gather(*service.tasks)
    outcomes = {outcome for _, outcome in decided}
    assert {"run", "wait", "rate_limit", "behind", "queue_full"} <= outcomes, outcomes  # every decision was met
    assert (service.queue.running, service.queue.waiting, service.backlog.pending) == (0, 0, 0)
    assert (door.queue.running, len(door.queue.waiting), door.backlog.pending) == (0, 0, 0)


@pytest.mark.parametrize("name", ["history", "rlp", "s3", "oracle"])
async def test_the_front_door_predicts_as_the_predictor_service_does(monkeypatch, name):
    """The same arrival times and ended lengths: the same estimates, padding and range, through Eq. 4's
    confidence at the arrival rate each measures."""
    clock = Clock()
    monkeypatch.setattr(predictor_app, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                                       perf_counter=clock.monotonic))
    service = predictor_app.PredictorRoutes(predictor_app.Config(predictor=name), CollectorRegistry())
    door = FrontDoor(AdmissionLimits(max_running=1000), PredictorSettings(name, max_tokens=512))
    rng = np.random.default_rng(7)
    arrivals, lengths = np.cumsum(rng.exponential(1 / 20.0, 80)), rng.integers(1, 400, 80)
    try:
        for i, (t, length) in enumerate(zip(arrivals.tolist(), lengths.tolist())):
            clock.now = t
            request = SimRequest(f"r{i}", t, 16, length)
            door.arrive(request, t)
            told = await service.predict(None, PredictRequest(max_tokens=512, tenant=TENANT, prompt_token_ids=[1],
                                                              true_length=length))
            assert request.predicted_output_len == told.estimated
            assert (request.predicted_output_low, request.predicted_output_median) == \
                predicted_range(told.predicted, told.padding, 512)  # admission's with_predicted_lengths
            if i % 3 == 0:  # some end before the next arrives, and their lengths are learned
                request.token_times = [t] * length
                door.finished(request)
                await service.observe(None, ObserveRequest(actual=length, tenant=TENANT))
    finally:
        service.worker.shutdown()
        service.trainer.shutdown()
