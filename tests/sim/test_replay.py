"""sim.workload.replay: a measured run's requests, as it sent them, through the simulated engine."""

import pytest

from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.simulate import simulate
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.workload import replay


def test_replay_keeps_each_request_as_given():
    requests = replay([0.0, 0.25, 0.25], [300, 12, 40], [20, 1, 7], ["a", "b", "c"])
    assert [(r.request_id, r.arrival, r.prompt_len, r.max_tokens) for r in requests] == \
        [("a", 0.0, 300, 20), ("b", 0.25, 12, 1), ("c", 0.25, 40, 7)]
    assert [r.request_id for r in replay([1.0, 2.0], [5, 5], [2, 2])] == ["r0", "r1"]


@pytest.mark.parametrize("args", [([0.0], [5, 6], [1]), ([0.0], [0], [1]), ([-1.0], [5], [1]),
                                  ([0.0], [5], [1], ["a", "b"])])
def test_replay_refuses_what_no_run_sent(args):
    with pytest.raises(ValueError):
        replay(*args)


def test_a_lone_replayed_request_takes_the_sum_of_its_steps():
    cost = StepCost(a=0.001, b=1e-5, c=2e-5)
    (request,) = replay([0.5], [100], [3])
    simulate(SimEngine(EngineSpec(token_budget=2048), cost), [request])
    prefill, decode = cost.seconds(100, 0, 0, 0), cost.seconds(0, 1, 0, 0)
    assert request.token_times[0] == pytest.approx(0.5 + prefill)
    assert request.finished_at == pytest.approx(0.5 + prefill + 2 * decode)
