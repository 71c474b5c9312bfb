"""Decode runs: steps of an engine computed at once because every decision in them is known.

When every running request is decoding, nobody waits (to be admitted, swapped back or pulled), the
allocation is vLLM's block at a time, and the free blocks cover every request's growth, the iteration
scheduler would give each running request its one token a step and call no policy: the admission
order has nobody to order, the preemption order nobody to pick. A request that samples its last
token leaves, and the others go on. So the steps can be taken together: their ends are the step
cost summed step by step (in the event loop's own arithmetic, so the times are the same floats), and
the requests' tokens, KV, blocks and ends are applied when the run is. This is where a cluster of
many engines spends most of its steps; taking them together is what makes it fast.

A request that arrives during a run joins it (`join`) when the scheduler's one decision about it is
known too: with FCFS admission and nobody else waiting it is admitted at the next step, its whole
prompt in that step when the token budget left by the decodes holds it, under the sequence limit,
and with blocks the run leaves spare for its prompt and its growth. The steps from its admission on
are costed again with its prefill, then its decodes. This is the common arrival at a busy engine;
it then costs no scheduler step, and the run goes on.

A run is cut by anything else that would change the batch (sim/cluster.py): a request added to the
engine that cannot join, or a pull landing. It is then applied through the step in progress, which
ends as planned (those it ends leave at its end), and the engine schedules as usual after it; a
request that had joined at a later step is still waiting there, and the scheduler admits it. A load
report ends the requests whose last token has come, and reads what applying the rest through the
step in progress would leave without applying them (`report`); it does not cut the run. It counts
the blocks they would hold without visiting them: a decoding request's blocks at a step follow from
its base and the step, and the run keeps the sum of its requests' bases by block (`_held_at`)."""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass, field

from kvmesh.policies.iteration import Status
from kvmesh.policies.prefill_admission import fcfs
from kvmesh.policies.step_shape import chunk_shape
from kvmesh.policies.views import blocks_for

from .request import SimRequest


# A run's next event comes at most its steps left at the least a step costs (the cost of a step of one
# decode), less this share, whatever the float sums' rounding: below the end of its last step.
ROUNDING = 2.0 ** -20


@dataclass
class DecodeRun:
    """A run's requests and its steps' ends so far. The ends are costed out as they are needed, up to
    the step in progress when something reads the run (`in_progress`): a join changes the steps from
    the next one on, so a run costs each step it takes once, and never one a join would cost again.
    Its event (`due`) comes at the end of its last step when all are costed, and before that at a
    bound below it: the steps left at the least a step costs (`floor`).

    Steps are numbered from 0, the run's first. A request decodes at each step from its first decode
    to its `stop`, exclusive; one that joined is admitted at its `start` and prefills its prompt then.
    A decode at step j reads its context `base` + j (the base counts back from the step it starts at),
    and once the steps before `through` are applied a request holds base + through - 1 tokens' blocks."""

    limit: int             # the steps it may take
    cost: object           # the engine's step cost, which no step costs less than `floor` on
    floor: float
    block_size: int
    leaving: list[tuple[int, int]]  # (stop, base) of each request, by stop
    slack: int             # free blocks, all layers, that its steps leave: what requests joining it may take
    # Each request it has not ended, in the order they came (the running ones, then those that joined),
    # by a number of its own: (request, start, stop, base), its admission step (0 but for those that
    # joined) and the step after its last, which samples its last token
    members: dict[int, tuple[SimRequest, int, int, int]] = field(default_factory=dict)
    entering: list[tuple[int, int]] = field(default_factory=list)  # (first decode, base) of those that joined, by step
    prefills: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # step -> joined prompts' tokens,
    #                                                                            their context, how many
    ends: list[float] = field(default_factory=list)     # each step's end time, so far
    seconds: list[float] = field(default_factory=list)  # each step's cost, so far
    applied: int = 0       # steps whose tokens and blocks the requests have
    version: int = 0       # moves on when it is cut: an event of an older one is stale
    _planned: int = 0      # requests decoding from the first step
    _entered: int = 0      # joined requests decoding by the next step to cost
    _gone: int = 0         # requests that ended before the next step to cost
    _context: int = 0      # the bases of the requests decoding at the next step to cost
    # What a heartbeat reads (`report`) without visiting every request: the members' stops (a heap of
    # (stop, number), each taken off as the member ends), the (start, base) of those that
    # joined at a step not yet applied, the blocks per layer the members hold, and their bases by
    # block: sum((base + block_size - 2) // block_size) and a count by (base + block_size - 2) % block_size.
    _stops: list[tuple[int, int]] = field(default_factory=list)
    _unapplied: list[tuple[int, int]] = field(default_factory=list)
    _numbered: int = 0
    _held: int = 0
    _whole: int = 0
    _residues: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._planned = len(self.leaving)
        self._context = sum(base for _, base in self.leaving)
        self._residues = [0] * self.block_size

    def add(self, request: SimRequest, start: int, stop: int, base: int) -> None:
        """Count the request among the run's (its steps are costed by `leaving` and `entering`)."""
        number = self._numbered
        self._numbered += 1
        self.members[number] = (request, start, stop, base)
        heapq.heappush(self._stops, (stop, number))
        self._held += request.blocks_per_layer
        whole, residue = divmod(base + self.block_size - 2, self.block_size)
        self._whole += whole
        self._residues[residue] += 1
        if start:
            insort(self._unapplied, (start, base))

    def _held_at(self, through: int) -> int:
        """The blocks per layer its members would hold with the steps before `through` applied, if each
        were decoding by then: ceil((base + through - 1) / block_size) summed, through the counts by
        block (as the residue plus through passes a block or not)."""
        size = self.block_size
        return self._whole + len(self.members) * (through // size) + sum(self._residues[size - through % size:])

    @property
    def end(self) -> float:
        return self.ends[-1]

    @property
    def more(self) -> bool:
        """Whether it may go on past the steps costed out."""
        return len(self.ends) < self.limit

    @property
    def due(self) -> float:
        """When its event comes: the end of its last step if all are costed out, else a time before it."""
        left = self.limit - len(self.ends)
        return self.ends[-1] + left * self.floor * (1.0 - ROUNDING) if left else self.ends[-1]

    def extend(self, start: float, steps: int) -> None:
        """Cost out `steps` more steps (within the limit), the first from `start`."""
        # The loop runs for every step simulated: its state is in locals.
        t, entering, leaving, prefills, seconds = start, self.entering, self.leaving, self.prefills, self.cost.seconds
        entered, gone, context, planned, joined = self._entered, self._gone, self._context, self._planned, len(entering)
        ends, costs = self.ends, self.seconds
        for j in range(len(ends), min(self.limit, len(ends) + steps)):
            while entered < joined and entering[entered][0] <= j:
                context += entering[entered][1]
                entered += 1
            while leaving[gone][0] <= j:  # it ended at the step before: no longer in the batch
                context -= leaving[gone][1]
                gone += 1
            batch = planned + entered - gone  # no swaps: nobody is preempted
            if j in prefills:
                prompt, pairs, sequences = prefills[j]
                cost = seconds(prompt, batch, context + batch * j, pairs, sequences)
            else:
                cost = seconds(0, batch, context + batch * j, 0)
            t = t + cost
            ends.append(t)
            costs.append(cost)
        self._entered, self._gone, self._context = entered, gone, context

    def in_progress(self, now: float) -> int:
        """How many steps have started by `now` (one ending at `now` counts: what happens at a step's
        end joins the step after it, as an arrival during a step does), costing them out as far as
        past `now`."""
        ends = self.ends
        while ends[-1] <= now and len(ends) < self.limit:  # as many steps as the last one's cost fills
            self.extend(ends[-1], 1 + int((now - ends[-1]) / self.seconds[-1]))
        return min(len(ends), bisect_left(ends, now) + 1)

    def cut(self, steps: int) -> None:
        """Keep only the first `steps` steps (costed out)."""
        if steps < self.limit:
            self.version += 1
        del self.ends[steps:], self.seconds[steps:]
        self.limit = steps

    def join(self, engine, request: SimRequest, now: float) -> bool:
        """Queue the request on the engine to be admitted at the next step, if that step's decision
        about it is known (the module's docstring), and cost the steps again from there; False (nothing
        changed) if not."""
        j = self.in_progress(now)
        spec, scheduler = engine.spec, engine.scheduler
        if j >= self.limit or scheduler.policies.prefill_admission is not fcfs or request.hold_kv or \
                request.awaits_kv or not engine.fits(request) or not scheduler.chunked_prefill:
            return False
        self._restart(j)  # costed again from step j whether it joins or not (the next read, if not)
        decodes, (prompts, pairs, joining) = self._decodes(j), self.prefills.get(j, (0, 0, 0))
        prompt, stop = request.prompt_len, j + request.max_tokens
        blocks = blocks_for(prompt + min(self.limit, stop) - j - 1, spec.block_size) * spec.num_layers
        if spec.token_budget - decodes - prompts < prompt or decodes + joining >= spec.max_num_seqs or \
                blocks > self.slack:
            return False
        scheduler.add(request)  # it fits: engine.add's check, made above
        self.slack -= blocks
        base = prompt - j  # its first decode, at j + 1, reads the prompt and its first token
        self.add(request, j, stop, base)
        self.entering.append((j + 1, base))  # after those before it: none joins at an earlier step
        insort(self.leaving, (stop, base))
        shape = chunk_shape(prompt, 0, prompt)
        self.prefills[j] = (prompts + shape[0], pairs + shape[3], joining + 1)
        return True

    def _decodes(self, j: int) -> int:
        """The requests decoding at step `j`, the next to cost, as `extend` counts them, without costing
        it (a join costs the steps from its own on again): the batch before it, with those that enter
        and leave at it (a step's worth of the lists at most, not a search of them)."""
        entering, leaving, entered, gone = self.entering, self.leaving, self._entered, self._gone
        while entered < len(entering) and entering[entered][0] <= j:
            entered += 1
        while leaving[gone][0] <= j:
            gone += 1
        return self._planned + entered - gone

    def _restart(self, steps: int) -> None:
        """Forget the steps costed from `steps` on, to cost them again: the batch goes back to what it
        was before the first of them."""
        del self.ends[steps:], self.seconds[steps:]
        while self._entered and self.entering[self._entered - 1][0] >= steps:
            self._entered -= 1
            self._context -= self.entering[self._entered][1]
        while self._gone and self.leaving[self._gone - 1][0] >= steps:
            self._gone -= 1
            self._context += self.leaving[self._gone][1]


def plan(engine, now: float, max_steps: int) -> DecodeRun | None:
    """The steps from `now` the engine (sim.engine.SimEngine) can take together, at most `max_steps`,
    or None when fewer than two; the first of them costed out. Its step cost must not fall as a step
    grows (the roofline; a fitted cost, none of whose terms is negative): a step of one decode is then
    the least one costs, and it must cost something."""
    scheduler, spec = engine.scheduler, engine.spec
    running = scheduler.running
    if scheduler.waiting or scheduler.swapped or scheduler.pulling or scheduler.allots_ahead or \
            scheduler.layered or scheduler.reuse is not None or not running or len(running) > spec.token_budget:
        return None
    if any(r.num_computed != r.num_tokens - 1 or r.num_computed < r.prompt_len for r in running):
        return None  # someone computes a prompt chunk, or its last prompt token: not a decode
    if any(r.blocks_per_layer != blocks_for(r.num_computed, spec.block_size) for r in running):
        return None  # blocks held ahead of its tokens: a heartbeat would count them wrong (DecodeRun._held_at)
    floor = engine.cost.seconds(0, 1, 0, 0)
    if floor <= 0:
        return None  # a step may cost nothing: no bound below a run's end for its event
    left = [r.max_tokens - r.num_generated for r in running]
    steps, need = _covered(running, left, min(max_steps, max(left)), spec.block_size, spec.num_layers, engine.free)
    if steps < 2:
        return None
    leaving = sorted((steps_left, r.num_computed + 1) for steps_left, r in zip(left, running))
    run = DecodeRun(steps, engine.cost, floor, spec.block_size, leaving, engine.free - need)
    for r, n in zip(running, left):
        run.add(r, 0, n, r.num_computed + 1)
    run.extend(now, 1)
    return run


def apply(engine, run: DecodeRun, through: int, ended: int) -> list[SimRequest]:
    """Give the requests the tokens, KV and blocks of the run's steps up to `through` (admitting those
    that joined at them), and end those whose last token came by step `ended` (<= through); the
    requests it ended."""
    done = []
    for number, (request, start, stop, _) in list(run.members.items()):
        _take(engine, run, request, start, stop, through, stop <= ended)
        if stop <= ended:
            done.append(_end(engine, run, number))
    while run._stops and run._stops[0][0] <= ended:
        heapq.heappop(run._stops)
    del run._unapplied[:bisect_left(run._unapplied, (through,))]
    engine.scheduler.iteration_s.extend(run.seconds[run.applied:through])
    engine.steps += through - run.applied
    run.applied = through
    return done


def report(engine, run: DecodeRun, through: int, ended: int) -> tuple[list[SimRequest], int, int, int]:
    """What a heartbeat reads of an engine in a run: the requests whose last token came by step `ended`
    (through - 1 or through) end (as `apply` would end them), and the others are counted, not applied,
    as `apply(engine, run, through, ended)` would leave them (their tokens are given once, when the run
    is cut or ends). The requests it ended, then the engine's free device blocks, waiting and running
    requests. It visits only the requests it ends: the others' blocks are the run's count
    (`DecodeRun._held_at`), less those that join at `through` or later, which hold none by then."""
    numbers = []
    while run._stops and run._stops[0][0] <= ended:
        numbers.append(heapq.heappop(run._stops)[1])
    done = []
    for number in sorted(numbers):  # in the order they came, as `apply` ends them
        request, start, stop, _ = run.members[number]
        _take(engine, run, request, start, stop, through, True)
        done.append(_end(engine, run, number))
    unapplied, size = run._unapplied, run.block_size
    later = bisect_left(unapplied, (through,))
    held = run._held_at(through) - sum((base + size - 2 + through) // size for _, base in unapplied[later:])
    grown = held - run._held
    return done, engine.free - grown * engine.spec.num_layers, len(engine.waiting) - later, \
        len(engine.running) + later


def _take(engine, run: DecodeRun, request: SimRequest, start: int, stop: int, through: int, ending: bool) -> None:
    """Give one request of the run its tokens, KV and blocks of the steps from those applied up to
    `through` (admitting it at its start if it joined). One `ending` (`_end` next) takes no blocks for
    its last tokens: it gives back every block it holds as it ends, so the free count comes out the same."""
    first = run.applied if run.applied < stop else stop
    first = start if first < start else first
    last = through if through < stop else stop
    if last <= first:
        return
    tokens = last - first
    if first == start and start:  # it joined: admitted at its start, its prompt computed then
        scheduler = engine.scheduler
        scheduler.waiting.remove(request)
        request.status = Status.RUNNING
        scheduler.running.append(request)
        request.scheduled_at = run.ends[start - 1] if request.scheduled_at is None else request.scheduled_at
        tokens += request.prompt_len - 1
    request.num_computed += tokens
    if request.token_times:
        request.token_times.extend(run.ends[first:last])
    else:  # its first tokens (one that joined): the slice is its list, copied once rather than twice
        request.token_times = run.ends[first:last]
    if ending:
        return
    blocks = blocks_for(request.num_computed, engine.spec.block_size)
    if blocks > request.blocks_per_layer:
        run._held += blocks - request.blocks_per_layer
        if not engine.blocks.reserve(request, blocks, tokens):
            raise AssertionError("a decode run's blocks were counted before it started")


def _end(engine, run: DecodeRun, number: int) -> SimRequest:
    """The member that has its last token leaves the run and the engine (at its last step's end)."""
    request, start, stop, base = run.members.pop(number)
    run._held -= request.blocks_per_layer
    whole, residue = divmod(base + run.block_size - 2, run.block_size)
    run._whole -= whole
    run._residues[residue] -= 1
    if start >= run.applied and start:  # joined at a step not applied before this
        run._unapplied.remove((start, base))
    engine.finish(request, run.ends[stop - 1])
    return request


def _covered(running: list[SimRequest], left: list[int], steps: int, block_size: int, num_layers: int,
             free: int) -> tuple[int, int]:
    """The most of `steps` steps whose blocks the free ones cover, counting none that an ending
    request gives back (so it may stop early, never late: the steps after run one at a time), and the
    blocks they take."""
    def need(k: int) -> int:
        return num_layers * sum(max(0, blocks_for(r.num_computed + min(k, n), block_size) - r.blocks_per_layer)
                                for r, n in zip(running, left))

    total = need(steps)
    if total <= free:
        return steps, total
    low, high = 0, steps
    while low < high:
        mid = (low + high + 1) // 2
        if need(mid) <= free:
            low = mid
        else:
            high = mid - 1
    return low, need(low)
