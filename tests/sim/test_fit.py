"""Calibration: the fit recovers known coefficients and copy rates, and a short real run on tiny
writes a profile, with the swap bandwidths the simulator then takes unless --swap-gbps says otherwise."""

import json

import numpy as np
import pytest

from kvmesh.cli import main
from kvmesh.sim import calibrate
from kvmesh.sim.fit import fit_copy_rate, fit_step_cost, recorded_shape
from kvmesh.sim.step_cost import TERMS, StepCost, load_profile, read_profile
from kvmesh.sim.tier_copies import CopyRate, load_swap_rates


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


def test_the_copy_rate_and_its_fixed_cost_are_recovered_from_exact_timings():
    truth = CopyRate(bytes_per_s=12e9, fixed_s=12e-6)
    sizes = [32768 * 4**i for i in range(5)]  # 16 to 4,096 tokens of tiny's KV
    rate, fit = fit_copy_rate(sizes, [truth.seconds(n) for n in sizes])
    assert rate.bytes_per_s == pytest.approx(truth.bytes_per_s, rel=1e-9)
    assert rate.fixed_s == pytest.approx(truth.fixed_s, rel=1e-9)
    assert fit["samples"] == 5 and fit["max_relative_error"] < 1e-9 and fit["copies"][0]["bytes"] == 32768


def test_a_copy_rate_whose_fixed_cost_would_be_negative_goes_through_the_origin():
    """Timings of 9, 20 and 40 us for 100, 200 and 400 kB: the line through them would start at -2 us,
    so the fixed cost is 0 and the rate the relative least squares through the origin:
    k = sum(x / y) / sum((x / y)^2) in bytes per second."""
    sizes, seconds = [100e3, 200e3, 400e3], [9e-6, 20e-6, 40e-6]
    rate, _ = fit_copy_rate(sizes, seconds)
    ratios = np.array(sizes) / np.array(seconds)
    assert rate.fixed_s == 0 and rate.bytes_per_s == pytest.approx((ratios ** 2).sum() / ratios.sum(), rel=1e-9)


def test_a_copy_rate_needs_two_sizes():
    with pytest.raises(ValueError, match="two sizes"):
        fit_copy_rate([1e6, 1e6], [1e-4, 1.1e-4])


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """A short calibration of tiny: two batches, two prompts, swaps of 16 and 256 tokens."""
    path = tmp_path_factory.mktemp("calibrate") / "tiny.json"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (("BATCHES", (1, 2)), ("PROMPTS", (16, 48)), ("DECODE_STEPS", 3), ("REPEATS", 1),
                            ("SWAP_TOKENS", (16, 256))):
            patch.setattr(calibrate, name, value)
        assert calibrate.run("tiny", "float32", 1, path) == 0
    return path


def test_a_short_calibration_on_tiny_writes_a_profile(tiny_profile):
    body = json.loads(tiny_profile.read_text())
    assert body["model"] == "tiny" and body["dtype"] == "float32" and body["threads"] == 1
    assert all(body["coefficients"][term]["origin"] for term in TERMS)
    assert body["fit"]["samples"] == len(body["fit"]["steps"]) >= len(TERMS)
    cost = load_profile(str(tiny_profile))
    assert cost.a >= 0 and cost.seconds(128, 4, 1000, 8256, 1) > 0


def test_the_calibration_measures_the_swaps_both_ways(tiny_profile):
    """A swap of 16 tokens of tiny in float32 copies one block of each of its 4 layers, 2 x 16 x 2 x 64
    x 4 bytes each; of 256 tokens, 16 blocks a layer."""
    tier = json.loads(tiny_profile.read_text())["tier"]
    for direction in ("swap_out", "swap_in"):
        assert tier[f"{direction}_bytes_per_s"]["value"] > 0 and tier[f"{direction}_fixed_s"]["value"] >= 0
        assert tier[f"{direction}_bytes_per_s"]["origin"]
        assert [c["bytes"] for c in tier["fit"][direction]["copies"]] == [4 * 16384, 16 * 4 * 16384]
    assert load_swap_rates(str(tiny_profile)) == {f"{d}_{term}": tier[f"{d}_{term}"]["value"]
                                                  for d in ("swap_out", "swap_in") for term in ("bytes_per_s", "fixed_s")}


@pytest.mark.parametrize("swap_gbps, expected", [((), None), (("--swap-gbps", "20:10"), (20e9, 10e9))])
def test_sim_run_swaps_at_the_profile_s_measured_bandwidth_unless_told(tmp_path, tiny_profile, swap_gbps, expected):
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--profile", str(tiny_profile), "--rate", "20", "--requests", "50",
                 "--cxl-blocks", "256", *swap_gbps, "--json", str(out)]) == 0
    engine = json.loads(out.read_text())["config"]["engine"]
    measured = load_swap_rates(str(tiny_profile))
    assert (engine["swap_out_bytes_per_s"], engine["swap_in_bytes_per_s"]) == \
        (expected or (measured["swap_out_bytes_per_s"], measured["swap_in_bytes_per_s"]))
    # A swap's fixed cost is the profile's either way: --swap-gbps gives bandwidths.
    assert (engine["swap_out_fixed_s"], engine["swap_in_fixed_s"]) == \
        (measured["swap_out_fixed_s"], measured["swap_in_fixed_s"])


@pytest.mark.parametrize("swap_gbps, expected", [((), (50e9, 50e9)), (("--swap-gbps", "20:10"), (20e9, 10e9))])
def test_sim_run_on_a_gpu_profile_swaps_at_its_deployment_s_tier_unless_told(tmp_path, swap_gbps, expected):
    """llama-3.1-70b on four L20s, each two sharing a PCIe Gen4 link: 12.5 GB/s a GPU each way, so the
    engine's tier is 50 GB/s (sim/hardware.py), not the 25 of EngineSpec's default."""
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--profile", "llama-3.1-70b-l20-bf16-tp4", "--rate", "2", "--requests", "10",
                 "--cxl-blocks", "256", *swap_gbps, "--json", str(out)]) == 0
    engine = json.loads(out.read_text())["config"]["engine"]
    assert (engine["swap_out_bytes_per_s"], engine["swap_in_bytes_per_s"]) == expected
    assert engine["swap_out_fixed_s"] == engine["swap_in_fixed_s"] == 0.0  # a GPU profile measured no swaps


def test_a_profile_without_a_tier_section_measured_no_swaps(tmp_path):
    body = read_profile("tiny-cpu-bfloat16-1t")
    del body["tier"]  # as profiles fitted before the swaps were timed, or by --from-engine
    path = tmp_path / "untimed.json"
    path.write_text(json.dumps(body))
    assert load_swap_rates(str(path)) == {}
