"""Decode runs (sim/decode_run.py) change how fast the simulator runs, never what it simulates: every
request's token times, finish, preemptions and hand-off are the same floats as when each engine
takes one step at a time, whatever cuts the runs (arrivals, load reports, pulls, preemptions)."""

import copy

import pytest

from kvmesh.sim import decode_run
from kvmesh.sim.cluster import build
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.link import LinkSpec
from kvmesh.sim.request import SimRequest
from kvmesh.sim.simulate import simulate
from kvmesh.sim.step_cost import StepCost, load_profile
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, poisson

COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)


def records(topology: str, spec: EngineSpec, rate: float, max_run_steps: int, **options) -> tuple[list[tuple], int]:
    requests = poisson(rate, 300, Lengths.parse("uniform:16-400"), Lengths.parse("exp:60"), seed=3)
    cluster = build(Topology.parse(topology), spec, options.pop("cost", COST), max_run_steps=max_run_steps, **options)
    cluster.run(requests)
    steps = sum(member.engine.steps for member in cluster.members.values())
    return [(r.token_times, r.finished_at, r.preemptions, r.transfer_s, r.scheduled_at) for r in requests], steps


@pytest.mark.parametrize("topology, spec, rate, options", [
    ("colocated:1", EngineSpec(device_blocks=4096), 4.0, {}),
    ("colocated:3", EngineSpec(device_blocks=4096), 20.0, {"routing": "round_robin"}),
    ("colocated:2", EngineSpec(device_blocks=320), 12.0, {"routing": "least_loaded"}),  # preempts
    ("colocated:2", EngineSpec(device_blocks=320, cxl_blocks=512, block_bytes=4096), 12.0,
     {"policies": {"preemption_strategy": "swap"}}),
    ("pd:1:2", EngineSpec(device_blocks=4096), 10.0, {"link": LinkSpec(gbps=1.0, latency_us=800.0)}),
    ("pd:2:1", EngineSpec(device_blocks=1024), 10.0, {"transfer_mode": "push", "heartbeat_s": 0.25}),
    ("pd:1:1", EngineSpec(device_blocks=4096), 6.0, {"heartbeat_s": 0.0}),
    ("colocated:4", EngineSpec(device_blocks=8192), 40.0, {"cost": load_profile("opt-13b-a100-fp16-tp1")}),
    ("colocated:2", EngineSpec(device_blocks=4096), 12.0, {"cost": StepCost(a=3e-3, b=1e-4, c=2e-4, f=5e-3)}),
])
def test_decode_runs_simulate_the_same_events_as_single_steps(topology, spec, rate, options):
    stepped, steps = records(topology, spec, rate, 0, **dict(options))
    ran, run_steps = records(topology, spec, rate, 512, **dict(options))
    assert ran == stepped and run_steps == steps


def test_a_run_goes_on_past_a_request_that_ends_and_stops_where_the_blocks_would_run_short():
    """Prompts of 8, blocks of 4 tokens; 11 and 9 tokens left to sample after the first: 11 steps,
    two decodes a step until the second request leaves after the ninth. Each needs a third block for
    its first decode (token 9), a fourth at token 13 and a fifth at token 17."""
    engine = SimEngine(EngineSpec(block_size=4, device_blocks=64), COST)
    first, second = SimRequest("a", 0.0, 8, 12), SimRequest("b", 0.0, 8, 10)
    for request in (first, second):
        engine.add(request)
    engine.complete(engine.schedule(0.0), 0.01)  # both prompts computed, first tokens sampled
    run = decode_run.plan(engine, 0.01, max_steps=100)
    assert run.limit == 11 and len(run.ends) == 1  # the rest is costed out as it is read
    assert run.in_progress(0.01 + 2.5 * COST.seconds(0, 2, 18, 0)) == 3 and len(run.ends) == 3
    run.extend(run.end, 100)
    t, ends = 0.01, []
    for j in range(11):  # each decode reads its whole context: 9 + 9 tokens at the first step
        t = t + (COST.seconds(0, 2, 18 + 2 * j, 0) if j < 9 else COST.seconds(0, 1, 9 + j, 0))
        ends.append(t)
    assert run.ends == ends
    assert decode_run.plan(engine, 0.01, max_steps=5).limit == 5

    for free, steps in ((6, 11), (5, 8), (4, 8), (3, 4), (2, 4)):
        engine.blocks.free_blocks["device"] = free
        assert decode_run.plan(engine, 0.01, max_steps=100).limit == steps
    engine.blocks.free_blocks["device"] = 1  # the first decode already needs a block each: preemption's
    assert decode_run.plan(engine, 0.01, max_steps=100) is None

    engine.blocks.free_blocks["device"] = 64 - 4
    ended = decode_run.apply(engine, run, 11, 11)
    assert ended == [first, second] and first.finished_at == ends[10] and second.finished_at == ends[8]
    assert first.token_times[1:] == ends and second.token_times[1:] == ends[:9]
    assert engine.free == 64 and not engine.running and engine.steps == 12


def test_a_run_cut_mid_way_is_applied_through_the_step_in_progress():
    """Cut in its third step, a run's requests have that step's token and blocks; one whose last
    token that step samples leaves at the step's end, not before."""
    engine = SimEngine(EngineSpec(device_blocks=4096), StepCost(a=0.01))
    long, short = SimRequest("a", 0.0, 16, 50), SimRequest("b", 0.0, 16, 4)
    for request in (long, short):
        engine.add(request)
    engine.complete(engine.schedule(0.0), 0.01)
    run = decode_run.plan(engine, 0.01, max_steps=10)
    steps = run.in_progress(0.035)  # the third step (0.03-0.04) is under way
    assert steps == 3 and run.in_progress(0.04) == 3  # one ending at that moment counts as under way
    run.cut(steps)
    assert decode_run.apply(engine, run, steps, steps - 1) == []
    assert long.num_generated == 4 and long.num_computed == 19 and engine.steps == 4
    assert short.num_generated == 4 and short.finished_at is None and short in engine.running
    assert long.token_times[1:] == pytest.approx([0.02, 0.03, 0.04])
    assert decode_run.apply(engine, run, steps, steps) == [short] and short.finished_at == pytest.approx(0.04)


def test_one_engine_alone_is_the_same_with_runs():
    requests = poisson(8.0, 200, Lengths.parse("uniform:32-256"), Lengths.parse("exp:80"), seed=5)
    again = [SimRequest(r.request_id, r.arrival, r.prompt_len, r.max_tokens) for r in requests]
    simulate(SimEngine(EngineSpec(), COST), requests)
    cluster = build(Topology.parse("colocated:1"), EngineSpec(), COST, routing="round_robin", max_run_steps=0)
    cluster.run(again)
    assert [r.token_times for r in requests] == [r.token_times for r in again]


def decoding(spec: EngineSpec, *requests: SimRequest) -> SimEngine:
    """An engine whose requests computed their prompts at 0.01 (one step) and decode from there."""
    engine = SimEngine(spec, COST)
    for request in requests:
        engine.add(request)
    engine.complete(engine.schedule(0.0), 0.01)
    return engine


def test_an_arrival_joins_a_run_at_the_next_step_and_prefills_its_whole_prompt_then():
    """Two requests decode (contexts 9 and 9 at the run's first step); c, a prompt of 6 and 3 tokens,
    arrives during the second step: the third computes its prompt (6 tokens, 21 query-key pairs)
    beside the two decodes, and it decodes in the fourth and fifth (reading 7, then 8)."""
    first, second, late = SimRequest("a", 0.0, 8, 12), SimRequest("b", 0.0, 8, 10), SimRequest("c", 0.015, 6, 3)
    engine = decoding(EngineSpec(block_size=4, device_blocks=64), first, second)
    run = decode_run.plan(engine, 0.01, max_steps=100)
    run.extend(run.end, 100)
    assert run.join(engine, late, run.ends[1] - 1e-4)
    assert late in engine.waiting and run.limit == 11 and len(run.ends) == 2  # the steps from the join go
    run.extend(run.end, 100)
    costs = [COST.seconds(0, 2, 18, 0), COST.seconds(0, 2, 20, 0), COST.seconds(6, 2, 22, 21),
             COST.seconds(0, 3, 24 + 7, 0), COST.seconds(0, 3, 26 + 8, 0)] + \
        [COST.seconds(0, 2, 18 + 2 * j, 0) if j < 9 else COST.seconds(0, 1, 9 + j, 0) for j in range(5, 11)]
    t, ends = 0.01, []
    for cost in costs:
        t = t + cost
        ends.append(t)
    assert run.ends == ends

    assert decode_run.apply(engine, run, 2, 2) == [] and late in engine.waiting  # not admitted yet
    assert decode_run.apply(engine, run, 5, 5) == [late]
    assert late.scheduled_at == ends[1] and late.token_times == ends[2:5] and late.finished_at == ends[4]
    assert late.num_computed == 8 and late not in engine.waiting and late not in engine.running
    assert engine.steps == 6 and list(engine.scheduler.iteration_s) == [engine.scheduler.iteration_s[0], *costs[:5]]


def test_an_arrival_the_step_cannot_take_whole_does_not_join():
    """A token budget of 8 leaves 6 beside two decodes: a prompt of 7 would be chunked, which is the
    scheduler's to do (the run is cut instead); nor does one join past the sequence limit."""
    engine = decoding(EngineSpec(block_size=4, device_blocks=64, token_budget=8, max_num_seqs=3),
                      SimRequest("a", 0.0, 4, 12), SimRequest("b", 0.0, 4, 10))
    run = decode_run.plan(engine, 0.01, max_steps=100)
    ends, version = list(run.ends), run.version
    assert not run.join(engine, SimRequest("c", 0.01, 7, 3), 0.012)
    assert run.ends[:len(ends)] == ends and run.version == version and not engine.waiting  # at most costed further
    assert run.join(engine, SimRequest("d", 0.01, 5, 3), 0.012)
    assert not run.join(engine, SimRequest("e", 0.01, 1, 3), 0.012)  # a, b and d: the limit of 3


def test_a_heartbeat_reads_what_applying_a_run_would_leave_and_only_ends_requests():
    """A heartbeat ends the requests whose last token has come, as applying the run through the step in
    progress would, and reads the free blocks, waiting and running requests that applying it would
    leave (one joining, two ending, blocks growing); the others' tokens wait for the run's end."""
    first, second, late = SimRequest("a", 0.0, 8, 12), SimRequest("b", 0.0, 8, 10), SimRequest("c", 0.015, 6, 3)
    engine = decoding(EngineSpec(block_size=4, device_blocks=64), first, second)
    run = decode_run.plan(engine, 0.01, max_steps=100)
    run.extend(run.end, 100)
    assert run.join(engine, late, run.ends[1] - 1e-4)
    run.extend(run.end, 100)
    running = []
    for steps in range(1, 12):
        applied_engine, applied_run = copy.deepcopy((engine, run))
        ended = decode_run.apply(applied_engine, applied_run, steps, steps - 1)
        reported_engine, reported_run = copy.deepcopy((engine, run))
        reported, *load = decode_run.report(reported_engine, reported_run, steps, steps - 1)
        assert [r.request_id for r in reported] == [r.request_id for r in ended]
        assert load == [applied_engine.free, len(applied_engine.waiting), len(applied_engine.running)]
        assert [r.token_times for r in reported] == [r.token_times for r in ended]
        assert reported_run.applied == 0 and reported_run.members[0][0].num_computed == 8
        running.append(load[2])
    assert running == [2, 2, 3, 3, 3, 2, 2, 2, 2, 1, 1]


def test_heartbeats_one_after_another_and_after_an_apply_read_what_applying_would_leave():
    """Reports on the same run, step after step (each ending some, the later ones after part of the run
    was applied), with requests joining at the third and the sixth step: each reads the free blocks,
    waiting and running requests that applying the run from the start through that step would leave."""
    engine = decoding(EngineSpec(block_size=4, device_blocks=128), SimRequest("a", 0.0, 8, 14),
                      SimRequest("b", 0.0, 5, 6), SimRequest("c", 0.0, 11, 21))
    run = decode_run.plan(engine, 0.01, max_steps=100)
    run.extend(run.end, 100)
    assert run.join(engine, SimRequest("d", 0.0, 6, 4), run.ends[1] - 1e-4)
    run.extend(run.end, 100)
    assert run.join(engine, SimRequest("e", 0.0, 13, 9), run.ends[4] - 1e-4)
    run.extend(run.end, 100)
    start = copy.deepcopy((engine, run))
    for steps in range(1, run.limit + 1):
        applied_engine, applied_run = copy.deepcopy(start)
        ended = decode_run.apply(applied_engine, applied_run, steps, steps - 1)
        expected = [applied_engine.free, len(applied_engine.waiting), len(applied_engine.running)]
        if steps == 9:  # part of the run applied: later reports count from there
            decode_run.apply(engine, run, steps, steps - 1)
            assert [engine.free, len(engine.waiting), len(engine.running)] == expected
            continue
        reported, *load = decode_run.report(engine, run, steps, steps - 1)
        assert load == expected, steps
        assert {r.request_id for r in reported} <= {r.request_id for r in ended}



def test_a_runs_event_comes_before_its_end_until_its_steps_are_costed_out_then_at_its_end():
    """Until every step is costed, a run's event (`due`) is at most its steps left at a step of one
    decode's cost past the last costed end, below the run's end; a join, which makes steps longer,
    leaves it below; once all are costed it is the end itself."""
    engine = decoding(EngineSpec(block_size=4, device_blocks=64), SimRequest("a", 0.0, 8, 12),
                      SimRequest("b", 0.0, 8, 10))
    run = decode_run.plan(engine, 0.01, max_steps=100)
    first_due = run.due
    assert run.floor == COST.seconds(0, 1, 0, 0) and first_due < run.ends[0] + 10 * run.floor
    assert run.join(engine, SimRequest("c", 0.0, 6, 3), run.ends[0] + 1e-4)
    assert run.due < run.ends[-1] + (run.limit - len(run.ends)) * run.floor
    run.extend(run.end, 100)
    assert not run.more and run.due == run.end > first_due


def test_no_run_when_a_step_may_cost_nothing():
    """A step cost that prices a decode at nothing bounds no run's end from below: every step alone."""
    engine = decoding(EngineSpec(block_size=4, device_blocks=64), SimRequest("a", 0.0, 8, 12))
    engine.cost = StepCost(a=0.0, b=1e-4)
    assert decode_run.plan(engine, 0.01, max_steps=100) is None
