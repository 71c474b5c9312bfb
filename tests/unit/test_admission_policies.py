"""Admission's decisions (policies/admission): the token bucket's closed form, the bounded queue's
run / wait / refuse and hand-over order, the expected-wait refusal, and the service's defaults; and
the admission service's BoundedQueue carrying the queue's decisions out for its tasks."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvmesh.policies.admission import Admit, AdmissionLimits, AdmissionQueue, RateLimiter, behind_by
from kvmesh.services.admission.config import Config
from kvmesh.services.admission.limits import BoundedQueue, QueueFull


def test_a_token_bucket_lets_in_its_burst_then_its_rate():
    # 3 at once, 2 a second; arrivals every 0.25 s for 9.75 s: 3 + floor(2 x 9.75) = 22 let in
    limiter = RateLimiter(requests_per_s=2.0, burst=3.0)
    waits = [limiter.take("key", j * 0.25) for j in range(40)]
    assert sum(w == 0.0 for w in waits) == 3 + 19
    # half a token back every 0.25 s: the sixth, at 1.25 s, finds half a token, 0.25 s short of a whole one
    assert waits[:6] == [0.0] * 5 + [0.25]
    assert RateLimiter(requests_per_s=2.0, burst=3.0).take("other", 0.0) == 0.0


def test_the_queue_runs_then_queues_then_refuses_and_hands_slots_on_in_arrival_order():
    queue: AdmissionQueue[str] = AdmissionQueue(max_running=2, max_queued=2)
    assert [queue.arrive(r) for r in "abcde"] == [Admit.RUN, Admit.RUN, Admit.WAIT, Admit.WAIT, Admit.FULL]
    assert queue.release() == "c" and queue.running == 2
    assert queue.arrive("f") is Admit.WAIT  # d and f wait
    assert queue.leave("d") and not queue.leave("d")
    assert [queue.release(), queue.release(), queue.release()] == ["f", None, None]
    assert queue.running == 0 and not queue.waiting
    with pytest.raises(ValueError):
        queue.release()


def test_a_free_slot_does_not_jump_the_queue():
    queue: AdmissionQueue[str] = AdmissionQueue(max_running=1, max_queued=0)
    assert [queue.arrive("a"), queue.arrive("b")] == [Admit.RUN, Admit.FULL]


@pytest.mark.parametrize("wait, ttft_slo_ms, max_wait_s, over", [
    (None, 1.0, 30.0, None),     # no estimate: let in
    (2.0, None, None, None),     # no limit
    (2.0, None, 30.0, None),     # within max_wait_s
    (31.5, None, 30.0, 1.5),     # over max_wait_s by 1.5 s
    (2.0, 500.0, 30.0, 1.5),     # the TTFT SLO is the limit when it has one
    (0.5, 500.0, 30.0, None),    # exactly at it: let in
])
def test_a_request_is_refused_by_what_it_can_expect_to_wait_past_its_limit(wait, ttft_slo_ms, max_wait_s, over):
    assert behind_by(wait, ttft_slo_ms, max_wait_s) == over


def test_the_limits_default_to_the_admission_services_own():
    service, limits = Config(), AdmissionLimits()
    for field in dataclasses.fields(limits):
        assert getattr(service, field.name) == getattr(limits, field.name), field.name


def one_slot_two_queued():
    """The service's queue of one slot and two places, the order tasks got their slot in, the event
    that lets them go, and the task body that holds a slot under a name until then."""
    queue = BoundedQueue(max_running=1, max_queued=2)
    order: list[str] = []
    release = asyncio.Event()

    async def hold(name: str) -> None:
        async with queue.slot():
            order.append(name)
            await release.wait()

    return queue, order, release, hold


async def test_the_services_queue_hands_a_slot_on_past_a_task_cancelled_while_queued():
    queue, order, release, hold = one_slot_two_queued()

    first = asyncio.create_task(hold("a"))
    await asyncio.sleep(0)
    gone, last = asyncio.create_task(hold("b")), asyncio.create_task(hold("c"))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        async with queue.slot():
            pass
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert (queue.running, queue.waiting) == (1, 1)
    release.set()
    await asyncio.gather(first, last)
    assert order == ["a", "c"] and (queue.running, queue.waiting) == (0, 0)


async def test_a_task_cancelled_as_its_slot_came_passes_the_slot_on():
    queue, order, release, hold = one_slot_two_queued()

    async def hold_then_cancel_the_next() -> None:
        await hold("a")
        handed.cancel()  # a's slot went to b as a left, and b has not run yet

    first = asyncio.create_task(hold_then_cancel_the_next())
    await asyncio.sleep(0)
    handed, last = asyncio.create_task(hold("b")), asyncio.create_task(hold("c"))
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, handed, last, return_exceptions=True)
    assert handed.cancelled() and order == ["a", "c"] and (queue.running, queue.waiting) == (0, 0)
