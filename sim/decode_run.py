"""Decode runs: steps of an engine computed at once because every decision in them is known.

When every running request is decoding, nobody waits (to be admitted, swapped back or pulled), the
allocation is vLLM's block at a time, and the free blocks cover every request's growth, the iteration
scheduler would give each running request its one token a step and call no policy: the admission
order has nobody to order, the preemption order nobody to pick. A request that samples its last
token leaves, and the others go on. So the steps can be taken together: their ends are the step
cost summed step by step (in the event loop's own arithmetic, so the times are the same floats), and
the requests' tokens, KV, blocks and ends are applied when the run is. This is where a cluster of
many engines spends most of its steps; taking them together is what makes it fast.

A run is cut by anything that would change the batch (sim/cluster.py): a request added to the
engine, a pull landing, or a load report routing reads. It is then applied through the step in
progress, which ends as planned (those it ends leave at its end), and the engine schedules as usual
after it."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from kvmesh.policies.views import blocks_for

from .request import SimRequest


FIRST_STEPS = 8  # the steps a run's plan costs out at first; it doubles them as they pass uncut


@dataclass
class DecodeRun:
    """A run's requests and its steps' ends so far. The ends are costed out as they are needed: most
    runs are cut after a few steps, so a plan costs what is run of it, not what could be."""

    requests: list[SimRequest]
    left: list[int]        # each request's steps in the run: the last one samples its last token
    limit: int             # the steps it may take
    cost: object           # the engine's step cost
    leaving: list[tuple[int, int]]  # (steps left, context at the first step) of each request, by steps left
    ends: list[float] = field(default_factory=list)     # each step's end time, so far
    seconds: list[float] = field(default_factory=list)  # each step's cost, so far
    applied: int = 0       # steps whose tokens and blocks the requests have
    _gone: int = 0         # requests that ended before the next step to cost
    _context: int = 0      # the context of the requests still in it, at the run's first step

    @property
    def end(self) -> float:
        return self.ends[-1]

    @property
    def more(self) -> bool:
        """Whether it may go on past the steps costed out."""
        return len(self.ends) < self.limit

    def extend(self, start: float, steps: int) -> None:
        """Cost out `steps` more steps (within the limit), the first from `start`."""
        n, t = len(self.leaving), start
        for j in range(len(self.ends), min(self.limit, len(self.ends) + steps)):
            while self.leaving[self._gone][0] <= j:  # it ended at the step before: no longer in the batch
                self._context -= self.leaving[self._gone][1]
                self._gone += 1
            batch = n - self._gone  # each decode reads its whole context; no swaps: nobody is preempted
            cost = self.cost.seconds(0, batch, self._context + batch * j, 0)
            t = t + cost
            self.ends.append(t)
            self.seconds.append(cost)

    def in_progress(self, now: float) -> int:
        """How many steps have started by `now` (one ending at `now` counts: what happens at a step's
        end joins the step after it, as an arrival during a step does)."""
        return min(len(self.ends), bisect_left(self.ends, now) + 1)

    def cut(self, steps: int) -> None:
        """Keep only the first `steps` steps."""
        del self.ends[steps:], self.seconds[steps:]
        self.limit = steps


def plan(engine, now: float, max_steps: int) -> DecodeRun | None:
    """The steps from `now` the engine (sim.engine.SimEngine) can take together, at most `max_steps`,
    or None when fewer than two; the first of them costed out."""
    scheduler, spec = engine.scheduler, engine.spec
    running = scheduler.running
    if scheduler.waiting or scheduler.swapped or scheduler.pulling or scheduler.allots_ahead or \
            scheduler.layered or scheduler.reuse is not None or not running or len(running) > spec.token_budget:
        return None
    if any(r.num_computed != r.num_tokens - 1 or r.num_computed < r.prompt_len for r in running):
        return None  # someone computes a prompt chunk, or its last prompt token: not a decode
    left = [r.max_tokens - r.num_generated for r in running]
    steps = _covered(running, left, min(max_steps, max(left)), spec.block_size, spec.num_layers, engine.free)
    if steps < 2:
        return None
    leaving = sorted((steps_left, r.num_computed + 1) for steps_left, r in zip(left, running))
    run = DecodeRun(list(running), left, steps, engine.cost, leaving, _context=sum(base for _, base in leaving))
    run.extend(now, FIRST_STEPS)
    return run


def apply(engine, run: DecodeRun, through: int, ended: int) -> list[SimRequest]:
    """Give the requests the tokens, KV and blocks of the run's steps up to `through`, and end those
    whose last token came by step `ended` (<= through); the requests it ended."""
    done, block_size = [], engine.spec.block_size
    for request, left in zip(run.requests, run.left):
        first, last = min(run.applied, left), min(through, left)
        if last > first:
            request.num_computed += last - first
            request.token_times.extend(run.ends[first:last])
            blocks = blocks_for(request.num_computed, block_size)
            if blocks > request.blocks_per_layer and not engine.blocks.reserve(request, blocks, last - first):
                raise AssertionError("a decode run's blocks were counted before it started")
        if left <= ended and request.finished_at is None:
            engine.finish(request, run.ends[left - 1])
            done.append(request)
    engine.scheduler.iteration_s.extend(run.seconds[run.applied:through])
    engine.steps += through - run.applied
    run.applied = through
    return done


def _covered(running: list[SimRequest], left: list[int], steps: int, block_size: int, num_layers: int,
             free: int) -> int:
    """The most of `steps` steps whose blocks the free ones cover, counting none that an ending
    request gives back (so it may stop early, never late: the steps after run one at a time)."""
    def need(k: int) -> int:
        return num_layers * sum(max(0, blocks_for(r.num_computed + min(k, n), block_size) - r.blocks_per_layer)
                                for r, n in zip(running, left))

    if need(steps) <= free:
        return steps
    low, high = 0, steps
    while low < high:
        mid = (low + high + 1) // 2
        if need(mid) <= free:
            low = mid
        else:
            high = mid - 1
    return low
