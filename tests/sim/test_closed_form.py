"""The simulator on cases with closed-form answers: one request's latency is the sum of its steps'
costs, and an engine serving one request at a time at a constant step cost is an M/D/1 queue."""

import numpy as np
import pytest

from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.simulate import simulate
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.workload import Lengths, poisson

COST = StepCost(a=3e-3, b=1e-4, c=2e-4, d=1e-6, e=3e-7)


def test_one_request_alone_takes_the_sum_of_its_steps():
    """Prompt 100 under a 32-token budget: prefill chunks of 32, 32, 32 and 4 (the last samples the
    first token), then one decode step for each of the other 4 tokens."""
    arrival, prompt, output = 1.25, 100, 5
    request = SimRequest("r0", arrival, prompt, output)
    simulate(SimEngine(EngineSpec(token_budget=32), COST), [request])

    t, expected = arrival, []
    for start, n in [(0, 32), (32, 32), (64, 32), (96, 4)]:  # each prompt token attends to itself and those before
        t += COST.a + COST.b * n + COST.e * (n * start + n * (n + 1) // 2)
    expected.append(t)
    for position in range(prompt, prompt + output - 1):  # a decode reads its whole context
        t += COST.a + COST.c + COST.d * (position + 1)
        expected.append(t)
    assert request.token_times == expected
    assert request.finished_at == expected[-1]


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_at_a_time_at_a_constant_cost_is_md1(rho):
    """Mean wait against Pollaczek-Khinchine, Wq = rho / (2 mu (1 - rho)). Successive waits are
    correlated, so the tolerance is 4 standard errors of the mean by batch means over the run (20
    batches of 5,000, each much longer than the queue's relaxation time of ~1/(1-rho)^2 services),
    and that error must itself be small for the check to say anything."""
    service = 0.01
    requests = poisson(rho / service, 100_000, Lengths.parse("8"), Lengths.parse("1"), seed=7)
    simulate(SimEngine(EngineSpec(max_num_seqs=1), StepCost(a=service)), requests)
    waits = np.array([r.token_times[0] - service - r.arrival for r in requests])
    expected = rho / (2 * (1 / service) * (1 - rho))
    batch_means = waits.reshape(20, -1).mean(axis=1)
    standard_error = batch_means.std(ddof=1) / np.sqrt(len(batch_means))
    assert standard_error < 0.05 * expected
    assert abs(waits.mean() - expected) < 4 * standard_error
