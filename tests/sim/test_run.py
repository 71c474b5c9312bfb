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
