"""`kvmesh sim run` end to end on every committed profile, and the workload it draws."""

import json

import pytest

from kvmesh.cli import main
from kvmesh.sim.step_cost import profile_names
from kvmesh.sim.workload import Lengths, poisson


@pytest.mark.parametrize("profile", profile_names())
def test_sim_run_prints_and_writes_the_figures(tmp_path, capsys, profile):
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--profile", profile, "--rate", "20", "--requests", "200",
                 "--policy", "preemption_order=srtf", "--device-blocks", "256", "--json", str(out)]) == 0
    assert "TTFT P50 / P90" in capsys.readouterr().out
    body = json.loads(out.read_text())
    assert body["config"]["policies"]["preemption_order"] == "srtf"
    results = body["results"]
    assert results["requests"] == 200 and results["unfinished"] == 0
    assert 0 < results["ttft_p50_s"] <= results["ttft_p90_s"] and results["tpot_mean_s"] > 0
    assert results["sim_per_wall"] > 0


def test_sim_run_refuses_an_unknown_policy(capsys):
    assert main(["sim", "run", "--requests", "5", "--policy", "preemption_order=nobody"]) == 2
    assert "nobody" in capsys.readouterr().err


def test_the_workload_is_the_same_for_the_same_seed():
    def draw(seed):
        return [(r.arrival, r.prompt_len, r.max_tokens)
                for r in poisson(5.0, 50, Lengths.parse("uniform:10-20"), Lengths.parse("exp:30"), seed)]
    assert draw(3) == draw(3) != draw(4)
    assert all(10 <= p <= 20 and o >= 1 for _, p, o in draw(3))


def _swap_run(tmp_path, *argv):
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--rate", "20", "--requests", "200", "--device-blocks", "256",
                 "--policy", "preemption_strategy=swap", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("text", ["300", "uniform:10-20", "exp:30", "lognormal:512:0.5"])
def test_lengths_print_as_they_are_read(text):
    assert str(Lengths.parse(text)) == text


def test_sim_run_swaps_to_a_cxl_tier_and_counts_the_bytes_copied(tmp_path):
    body = _swap_run(tmp_path, "--cxl-blocks", "1024", "--swap-gbps", "20:10")
    engine, results = body["config"]["engine"], body["results"]
    # One simulated block is 16 tokens of every layer of the tiny model (4 layers, 2 KV heads of 64, bf16),
    # since --num-layers is 1: K and V, 2 x 16 x 2 x 64 x 2 bytes a layer, times 4.
    assert engine["block_bytes"] == 4 * 2 * 16 * 2 * 64 * 2 == 32768
    assert engine["cxl_blocks"] == 1024
    assert (engine["swap_out_bytes_per_s"], engine["swap_in_bytes_per_s"]) == (20e9, 10e9)
    swaps = results["preemptions_by_strategy"]
    assert swaps.get("swap", 0) > 0 and sum(swaps.values()) == results["preemptions"]
    copied_out, copied_in = results["swap_out_bytes"], results["swap_in_bytes"]
    assert copied_out >= swaps["swap"] * 32768 and copied_out % 32768 == 0
    assert 0 < copied_in <= copied_out and copied_in % 32768 == 0


def test_sim_run_without_a_cxl_tier_swaps_nothing(tmp_path):
    results = _swap_run(tmp_path)["results"]
    assert results["preemptions"] > 0
    assert results["preemptions_by_strategy"] == {"recompute": results["preemptions"]}
    assert results["swap_out_bytes"] == results["swap_in_bytes"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--cxl-blocks", "-1"], "--cxl-blocks: must be 0 or more, got -1"),
    (["--swap-gbps", "x"], "--swap-gbps: give OUT:IN GB/s"),
    (["--swap-gbps", "10:0"], "--swap-gbps: give OUT:IN GB/s"),
])
def test_sim_run_refuses_a_bad_cxl_tier(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["sim", "run", "--requests", "5", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_sim_run_refuses_a_block_that_splits_a_layer(capsys):
    assert main(["sim", "run", "--requests", "5", "--cxl-blocks", "64", "--num-layers", "3"]) == 2
    assert "--num-layers 3 must divide --kv-geometry's 4 layers" in capsys.readouterr().err
