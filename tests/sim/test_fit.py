"""Calibration: the fit recovers known coefficients, and a short real run on tiny writes a profile."""

import json

import numpy as np
import pytest

from kvmesh.sim import calibrate
from kvmesh.sim.fit import fit_step_cost, recorded_shape
from kvmesh.sim.step_cost import TERMS, StepCost, load_profile


def test_the_fit_recovers_known_coefficients_from_exact_timings():
    truth = StepCost(a=1.5e-3, b=8e-5, c=1.4e-4, d=3e-7, e=2e-8, f=4e-3)
    rng = np.random.default_rng(0)
    shapes = [tuple(int(x) for x in shape) for shape in zip(rng.integers(0, 4096, 40), rng.integers(0, 64, 40),
                                                            rng.integers(0, 100_000, 40), rng.integers(0, 10**6, 40),
                                                            rng.integers(0, 16, 40))]
    for relative in (True, False):
        cost, fit = fit_step_cost(shapes, [truth.seconds(*s) for s in shapes], relative=relative)
        for term in TERMS:
            assert getattr(cost, term) == pytest.approx(getattr(truth, term), rel=1e-9)
        assert fit["max_relative_error"] < 1e-9 and fit["held_at_zero"] == []


def test_the_prefill_sequence_term_prices_a_short_prompt_beside_long_ones():
    """Steps of 1 to 6 prompts of 60, 384 or 1536 tokens: with a cost per prompt chunk (f) in the truth,
    the fit recovers it exactly; fitted on the long prompts alone without f, a short one is priced low."""
    truth = StepCost(a=1e-3, b=1e-5, e=2e-9, f=2e-2)
    shapes = [(n * p, 0, 0, n * p * (p + 1) // 2, n) for p in (60, 384, 1536) for n in range(1, 7)]
    cost, _ = fit_step_cost(shapes, [truth.seconds(*s) for s in shapes])
    assert cost.f == pytest.approx(truth.f, rel=1e-9) and cost.b == pytest.approx(truth.b, rel=1e-9)
    long_only = [s for s in shapes if s[0] == 1536 * s[4]]
    without, fit = fit_step_cost(long_only, [truth.seconds(*s) for s in long_only], held=("f",))
    assert without.f == 0 and fit["held_at_zero"] == ["f"]
    assert without.seconds(60, 0, 0, 1830, 1) < 0.5 * truth.seconds(60, 0, 0, 1830, 1)


def test_the_staged_bytes_term_is_recovered_beside_steps_that_stage_nothing():
    """Decode steps of 1, 2 or 4 requests of 512 or 1536 tokens, each with nothing staged and with
    every context's 8 kB a token copied through the staging area: the fit recovers g exactly, and a
    shape alone (a step record from before staged bytes) stages nothing."""
    truth = StepCost(a=1e-3, c=5e-5, d=2e-7, g=3e-11)
    rows = [(0, n, n * c, 0, 0, staged) for n in (1, 2, 4) for c in (512, 1536) for staged in (0, n * c * 8192)]
    cost, fit = fit_step_cost(rows, [truth.seconds(*r) for r in rows])
    assert cost.g == pytest.approx(truth.g, rel=1e-9) and cost.d == pytest.approx(truth.d, rel=1e-9)
    assert fit["steps"][1]["staged_bytes"] == 512 * 8192
    step = {"prefill_tokens": 1, "decode_tokens": 2, "decode_context": 3, "prefill_context": 4, "prefill_sequences": 5}
    assert recorded_shape(step) == (1, 2, 3, 4, 5, 0)
    assert recorded_shape(step | {"staged_bytes": 6}) == (1, 2, 3, 4, 5, 6)


def test_a_term_that_would_be_negative_is_held_at_zero():
    shapes = [(p, 0, 0, p * p, 1) for p in (10, 20, 40, 80)] + [(0, 1, 50, 0, 0), (0, 2, 400, 0, 0),
                                                                 (0, 4, 100, 0, 0), (0, 8, 1600, 0, 0)]
    seconds = [1e-3 + 1e-4 * p + 5e-5 * d - 1e-7 * c + 1e-8 * pc for p, d, c, pc, _ in shapes]  # the truth has d < 0
    cost, fit = fit_step_cost(shapes, seconds)
    assert cost.d == 0 and "d" in fit["held_at_zero"] and min(cost.a, cost.b, cost.c, cost.e, cost.f) >= 0


def test_a_profile_written_before_the_prefill_sequence_term_loads_with_it_at_zero(tmp_path):
    body = {"model": "tiny", "coefficients": {term: {"value": value, "origin": "test"} for term, value in
                                              zip("abcde", (1e-3, 4e-5, 5e-5, 2e-7, 1e-7))}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(body))
    assert load_profile(str(path)) == StepCost(a=1e-3, b=4e-5, c=5e-5, d=2e-7, e=1e-7, f=0.0)


def test_a_short_calibration_on_tiny_writes_a_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "BATCHES", (1, 2))
    monkeypatch.setattr(calibrate, "PROMPTS", (16, 48))
    monkeypatch.setattr(calibrate, "DECODE_STEPS", 3)
    monkeypatch.setattr(calibrate, "REPEATS", 1)
    path = tmp_path / "tiny.json"
    assert calibrate.run("tiny", "float32", 1, path) == 0

    body = json.loads(path.read_text())
    assert body["model"] == "tiny" and body["dtype"] == "float32" and body["threads"] == 1
    assert all(body["coefficients"][term]["origin"] for term in TERMS)
    assert body["fit"]["samples"] == len(body["fit"]["steps"]) >= len(TERMS)
    cost = load_profile(str(path))
    assert cost.a >= 0 and cost.seconds(128, 4, 1000, 8256, 1) > 0
