"""Decode runs: steps of an engine computed at once because every decision in them is known.

When every running request is decoding, nobody waits (to be admitted, swapped back or pulled), the
allocation is vLLM's block at a time, and the free blocks cover every request's growth, the iteration
scheduler would give each running request its one token a step and call no policy: the admission
order has nobody to order, the preemption order nobody to pick, as long as nobody ends. So the
steps until the one in which the first request ends can be taken together: their ends are the step
cost summed step by step (in the event loop's own arithmetic, so the times are the same floats),
and the requests' tokens, KV and blocks move on when the run is applied. This is where a cluster of
many engines spends most of its steps; taking them together is what makes it fast.

A run is cut by anything that would change the batch (sim/cluster.py): a request added to the
engine, or a load report routing reads. It is then applied through the step in progress, which
ends as planned, and the engine schedules as usual after it."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from kvmesh.policies.views import blocks_for

from .request import SimRequest


@dataclass
class DecodeRun:
    requests: list[SimRequest]
    ends: list[float]      # each step's end time
    seconds: list[float]   # each step's cost
    applied: int = 0       # steps whose tokens and blocks the requests have

    @property
    def end(self) -> float:
        return self.ends[-1]

    def in_progress(self, now: float) -> int:
        """How many steps have started by `now` (one ending at `now` counts: what happens at a step's
        end joins the step after it, as an arrival during a step does)."""
        return min(len(self.ends), bisect_left(self.ends, now) + 1)

    def cut(self, steps: int) -> None:
        """Keep only the first `steps` steps."""
        del self.ends[steps:], self.seconds[steps:]


def plan(engine, now: float, max_steps: int) -> DecodeRun | None:
    """The steps from `now` the engine (sim.engine.SimEngine) can take together, at most `max_steps`,
    or None when fewer than two: the last step before a request ends is run as usual, so the run
    stops one step short of it."""
    scheduler, spec = engine.scheduler, engine.spec
    running = scheduler.running
    if scheduler.waiting or scheduler.swapped or scheduler.pulling or scheduler.allots_ahead or \
            scheduler.layered or scheduler.reuse is not None or not running or len(running) > spec.token_budget:
        return None
    if any(r.num_computed != r.num_tokens - 1 or r.num_computed < r.prompt_len for r in running):
        return None  # someone computes a prompt chunk, or its last prompt token: not a decode
    steps = min(max_steps, min(r.max_tokens - r.num_generated for r in running) - 1)
    steps = _covered(running, steps, spec.block_size, spec.num_layers, engine.free)
    if steps < 2:
        return None
    n = len(running)
    context = sum(r.num_computed + 1 for r in running)  # each decode reads its whole context
    ends, seconds, t = [], [], now
    for j in range(steps):
        cost = engine.cost.seconds(0, n, context + n * j, 0)  # no swaps: nobody is preempted
        t = t + cost
        ends.append(t)
        seconds.append(cost)
    return DecodeRun(list(running), ends, seconds)


def apply(engine, run: DecodeRun, through: int) -> None:
    """Give the requests the tokens, KV and blocks of the run's steps up to `through`."""
    new = run.ends[run.applied:through]
    if not new:
        return
    k = len(new)
    for request in run.requests:
        request.num_computed += k
        request.token_times.extend(new)
        if not engine.blocks.reserve(request, blocks_for(request.num_computed, engine.spec.block_size), k):
            raise AssertionError("a decode run's blocks were counted before it started")
    engine.scheduler.iteration_s.extend(run.seconds[run.applied:through])
    engine.steps += k
    run.applied = through


def _covered(running: list[SimRequest], steps: int, block_size: int, num_layers: int, free: int) -> int:
    """The most of `steps` decode steps whose blocks the free ones cover (the growth only rises)."""
    def need(k: int) -> int:
        return num_layers * sum(max(0, blocks_for(r.num_computed + k, block_size) - r.blocks_per_layer)
                                for r in running)

    low, high = 0, steps
    while low < high:
        mid = (low + high + 1) // 2
        if need(mid) <= free:
            low = mid
        else:
            high = mid - 1
    return low
