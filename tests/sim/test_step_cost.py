"""The step cost's per-prefill-sequence term (f) as the simulator charges it: once per prompt chunk in a
step, whether the engine steps one at a time or in a decode run."""

from __future__ import annotations

import pytest

from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost

COST = StepCost(a=1e-3, b=1e-5, c=2e-5, d=1e-7, e=1e-8, f=4e-3)


def test_a_step_of_three_prompts_pays_the_prefill_sequence_term_three_times():
    engine = SimEngine(EngineSpec(device_blocks=4096), COST)
    for i, prompt in enumerate((60, 8, 30)):
        engine.add(SimRequest(f"r{i}", 0.0, prompt, 4))
    step = engine.schedule(0.0)
    pairs = sum(p * (p + 1) // 2 for p in (60, 8, 30))
    assert step.prefill_sequences == 3
    assert engine.seconds(step) == pytest.approx(1e-3 + 1e-5 * 98 + 1e-8 * pairs + 3 * 4e-3, rel=1e-12)
    engine.complete(step, engine.seconds(step))
    decodes = engine.schedule(1.0)
    assert decodes.prefill_sequences == 0 and engine.seconds(decodes) == pytest.approx(
        1e-3 + 2e-5 * 3 + 1e-7 * (61 + 9 + 31), rel=1e-12)
