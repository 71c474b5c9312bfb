"""`kvmesh plan`: the pick is the configuration of the highest goodput per engine; goodput is found by
bisection (checked on curves of known answer); bad input is refused before anything runs."""

import json

import pytest

from kvmesh.cli import main
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.metrics import slo_attainment
from kvmesh.sim.plan_search import (Candidate, Simulator, bisect_goodput, engine_choices, parse_counts, parse_slos,
                                    search_space)
from kvmesh.sim.plan_workload import planned_requests
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths

TINY_SEARCH = ["--rate", "20", "--requests", "200", "--prompt", "uniform:64-256", "--output", "exp:32",
               "--slo", "ttft=200", "--slo", "tpot=20", "--engines", "2", "--routing", "least_loaded",
               "--transfer-modes", "pull,push", "--kv-allocations", "block_at_a_time",
               "--preemption-orders", "latest_arrival_first", "--front-doors", "off"]


def test_plan_picks_the_configuration_of_the_highest_goodput_per_engine(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", *TINY_SEARCH, "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    body = json.loads(out.read_text())
    results = body["results"]
    assert sorted(r["configuration"] for r in results) == [  # no cxl tier: recompute only
        "colocated:2 least_loaded block_at_a_time latest_arrival_first recompute",
        "pd:1:1 least_loaded pull block_at_a_time latest_arrival_first recompute",
        "pd:1:1 least_loaded push block_at_a_time latest_arrival_first recompute"]
    best = max(results, key=lambda r: r["goodput_per_engine_rps"])
    pick = body["pick"]
    assert pick["winner"]["configuration"] == best["configuration"]
    assert pick["goodput_per_engine_rps"] == best["goodput_per_engine_rps"] == best["goodput_rps"] / 2
    for r in results:  # the bisection's bracket: met at goodput, missed at the first rate above it
        probes = {p["rate_rps"]: p["attainment"]["all"] for p in r["probes"]}
        assert probes[r["goodput_rps"]] >= 0.9 > probes[r["failed_at_rps"]]
        assert set(r["probes"][0]["attainment"]) == {"ttft", "tpot", "all"}
    runner = pick["runner_up"]
    assert runner["goodput_per_engine_rps"] < best["goodput_per_engine_rps"]
    assert runner["why"]["binding_slo"] in ("ttft", "tpot") and runner["why"]["it"]["attainment"]["all"] < 0.9
    assert "--requests" in pick["short_horizon"]  # 200 requests at the goodput: under 10 x the TTFT SLO
    assert pick["replicas"] == 1 and body["config"]["slos_ms"] == {"ttft": 200.0, "tpot": 20.0}
    assert f"pick: {best['configuration']}" in printed and "runner-up:" in printed and "why:" in printed
    assert png.stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--profile", "no-such-profile"], "no-such-profile"),
    (["--slo", "ttft:250"], "ttft:250"),
    (["--slo", "latency=250"], "latency=250"),
    (["--engines", "1", "--topologies", "pd"], "search space is empty"),
    (["--routing", ""], "search space is empty"),
    (["--routing", "nobody"], "nobody"),
    (["--cxl-blocks", "64", "--num-layers", "3"], "--num-layers 3 must divide --kv-geometry's 4 layers"),
    (["--kv-allocations", "block_at_a_time,nope"], "nope"),
    (["--preemption-strategies", "nope"], "nope"),
    (["--policy", "layer_offload=layerkv"], "searched by --layer-offloads"),
    (["--layer-offloads", "layerkv"], "needs a cxl tier"),
    (["--layer-offloads", "sometimes"], "'sometimes'"),
    (["--policy", "preemption_strategy=nope"], "nope"),
    (["--policy", "swap"], "give HOOK=NAME"),
])
def test_plan_refuses_bad_input_and_writes_nothing(tmp_path, capsys, argv, message):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", *TINY_SEARCH, *argv, "--json", str(out), "--plot", str(png)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert not out.exists() and not png.exists()


def test_bisection_finds_where_a_falling_attainment_crosses_the_target():
    # attainment 1 - rate / 100 crosses 90% at 10 req/s exactly
    found = bisect_goodput(lambda rate: 1 - rate / 100, 0.9, start=3.0, tolerance=0.01)
    assert found.rate <= 10 < found.failed_at and found.failed_at - found.rate <= 0.01 * found.failed_at
    assert [rate for rate, _ in found.probes[:3]] == [3.0, 6.0, 12.0]  # doubled until it missed


def test_bisection_brackets_a_step_from_above_and_stops_at_its_ends():
    found = bisect_goodput(lambda rate: 1.0 if rate <= 7.3 else 0.0, 0.9, start=64.0, tolerance=0.02)
    assert [rate for rate, _ in found.probes[:5]] == [64.0, 32.0, 16.0, 8.0, 4.0]  # halved until it met
    assert found.rate <= 7.3 < found.failed_at <= found.rate / 0.98
    assert bisect_goodput(lambda rate: 1.0, 0.9, 1.0).failed_at is None       # met up to 2**10 x the start
    assert bisect_goodput(lambda rate: 0.0, 0.9, 1.0).rate == 0.0             # missed down to 2**-10 x


def test_attainment_counts_each_slo_and_all_of_them():
    def served(ttft, gap, tokens):
        request = SimRequest("r", 0.0, 10, tokens)
        request.token_times = [ttft + gap * i for i in range(tokens)]
        request.finished_at = request.token_times[-1]
        return request

    requests = [served(0.1, 0.01, 11), served(0.3, 0.01, 11), served(0.1, 0.05, 11), served(0.1, 1.0, 1),
                SimRequest("unfinished", 0.0, 10, 5)]
    assert slo_attainment(requests, {"ttft": 0.2, "tpot": 0.02}) == {"ttft": 0.6, "tpot": 0.6, "all": 0.4}
    assert slo_attainment(requests, {"e2e": 0.25}) == {"e2e": 0.4, "all": 0.4}


def test_slos_and_engine_counts_parse():
    assert parse_slos(["ttft=250", "tpot=25ms,e2e=1.5s"]) == pytest.approx({"ttft": 0.25, "tpot": 0.025, "e2e": 1.5})
    assert parse_counts("2") == [2] and parse_counts("1-3,6") == [1, 2, 3, 6]
    for bad in ("ttft", "ttft=", "ttft=-1", "ttft=nan", "tbt=20"):
        with pytest.raises(ValueError, match="NAME=LIMIT"):
            parse_slos([bad])
    with pytest.raises(ValueError, match="engine counts"):
        parse_counts("0-2")


def test_the_search_space_splits_every_engine_count_and_tries_transfer_modes_only_on_pd():
    one = {"kv_allocation": ["cacheopt"], "preemption_order": ["srtf"], "preemption_strategy": ["swap"]}
    space = search_space([1, 3], ["colocated", "pd"], ["least_loaded"], ["pull", "push"], one)
    assert [str(c).replace(" cacheopt srtf swap", "") for c in space] == [
        "colocated:1 least_loaded", "colocated:3 least_loaded", "pd:1:2 least_loaded pull", "pd:1:2 least_loaded push",
        "pd:2:1 least_loaded pull", "pd:2:1 least_loaded push"]
    two = one | {"kv_allocation": ["block_at_a_time", "s3"], "preemption_strategy": ["recompute", "swap"]}
    assert [str(c) for c in search_space([1], ["colocated"], ["round_robin"], [], two)] == [
        "colocated:1 round_robin block_at_a_time srtf recompute", "colocated:1 round_robin block_at_a_time srtf swap",
        "colocated:1 round_robin s3 srtf recompute", "colocated:1 round_robin s3 srtf swap"]


SEARCHED = {"kv_allocation": ["block_at_a_time", "cacheopt"], "preemption_order": ["srtf", "lkvo"],
            "preemption_strategy": ["recompute", "swap", "sweet_spot"]}


def test_the_preemption_strategy_is_searched_only_with_a_cxl_tier_to_swap_to():
    assert engine_choices({}, SEARCHED, cxl_tier=True) == ({}, SEARCHED)
    assert engine_choices({}, SEARCHED, cxl_tier=False) == ({}, SEARCHED | {"preemption_strategy": ["recompute"]})


def test_a_policy_given_fixes_its_hook_whether_searched_or_not():
    fixed, choices = engine_choices({"kv_allocation": "s3", "preemption_strategy": "swap", "cache_policy": "car"},
                                    SEARCHED, cxl_tier=False)
    assert fixed == {"cache_policy": "car"}
    assert choices == {"kv_allocation": ["s3"], "preemption_order": ["srtf", "lkvo"], "preemption_strategy": ["swap"]}


def test_each_allocation_runs_the_same_requests_with_its_own_estimate_and_the_slos():
    args = (20.0, 200, Lengths.parse("uniform:64-256"), Lengths.parse("exp:32"), 0, {"ttft": 0.2, "tpot": 0.02})
    plain, cacheopt, s3 = (planned_requests(*args, allocation) for allocation in ("block_at_a_time", "cacheopt", "s3"))
    assert [(r.arrival, r.prompt_len, r.max_tokens) for r in plain] == \
        [(r.arrival, r.prompt_len, r.max_tokens) for r in cacheopt]
    assert all(r.predicted_output_len is None for r in plain)
    longest = max(r.max_tokens for r in plain)
    assert all(1 <= r.predicted_output_len <= longest for r in cacheopt)
    assert all(r.predicted_output_len % 50 == 0 or r.predicted_output_len == longest for r in s3)  # S^3's buckets
    assert {(r.ttft_slo_ms, r.tbt_slo_ms) for r in plain + cacheopt} == {(200.0, 20.0)}


def test_a_run_without_preemption_stands_for_every_preemption_order_and_strategy():
    simulator = Simulator(Lengths.parse("64"), Lengths.parse("8"), 50, 0, {"ttft": 0.1}, EngineSpec(),
                          StepCost(a=1e-3, b=1e-5))
    first = simulator.run(Candidate(Topology(colocated=1), "least_loaded", "latest_arrival_first"), 10.0)
    again = simulator.run(Candidate(Topology(colocated=1), "least_loaded", "srtf", preemption_strategy="swap"), 10.0)
    assert first.preemptions == 0 and again is first and (simulator.simulated, simulator.shared) == (1, 1)


def test_plan_runs_its_engines_with_the_cxl_tier_and_geometry_asked_for(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", *TINY_SEARCH, "--engines", "1", "--topologies", "colocated", "--requests", "50",
                 "--kv-geometry", "2:2:64:2", "--cxl-blocks", "512", "--swap-gbps", "8",
                 "--policy", "preemption_strategy=swap", "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["engine_policies"] == {} and config["search"]["preemption_strategy"] == ["swap"]
    assert config["kv_geometry"] == {"num_layers": 2, "kv_heads": 2, "head_dim": 64, "dtype_bytes": 2}
    assert config["engine"]["cxl_blocks"] == 512 and config["engine"]["block_bytes"] == 2 * 2 * 16 * 2 * 64 * 2
    assert config["engine"]["swap_out_bytes_per_s"] == config["engine"]["swap_in_bytes_per_s"] == 8e9


def test_each_configuration_runs_its_own_preemption_strategy():
    """A pool too small for the load preempts; with a cxl tier and swap the preempted keep their KV."""
    spec = EngineSpec(device_blocks=96, cxl_blocks=512, block_bytes=4096)
    simulator = Simulator(Lengths.parse("uniform:64-256"), Lengths.parse("exp:64"), 200, 0, {"ttft": 0.1}, spec,
                          StepCost(a=1e-3, b=1e-5, c=2e-4))
    runs = {strategy: simulator.run(Candidate(Topology(colocated=1), "least_loaded", "latest_arrival_first",
                                              preemption_strategy=strategy), 40.0)
            for strategy in ("recompute", "swap")}
    assert runs["recompute"].preemptions > 0 and runs["swap"].preemptions > 0
    assert runs["swap"] != runs["recompute"] and simulator.simulated == 2


def test_plan_searches_allocations_and_strategies_and_states_the_predictions(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *TINY_SEARCH, "--engines", "1", "--topologies", "colocated", "--requests", "100",
                 "--device-blocks", "96", "--cxl-blocks", "512", "--kv-allocations", "block_at_a_time,cacheopt",
                 "--preemption-strategies", "recompute,swap", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert sorted((r["kv_allocation"], r["preemption_strategy"]) for r in body["results"]) == [
        ("block_at_a_time", "recompute"), ("block_at_a_time", "swap"), ("cacheopt", "recompute"), ("cacheopt", "swap")]
    assert body["config"]["search"]["kv_allocation"] == ["block_at_a_time", "cacheopt"]
    predictions = body["config"]["predictions"]
    assert predictions["rules"] == {"cacheopt": "cacheopt"} and predictions["log_sigma"] == 0.5
    assert "predicted output lengths (cacheopt): each request's real output length" in capsys.readouterr().out


def test_configurations_that_ran_the_same_runs_share_one_row(capsys):
    """On a pool that never falls short, block at a time and rlp run alike, and so do the orders."""
    assert main(["plan", *TINY_SEARCH, "--engines", "1", "--topologies", "colocated", "--kv-allocations",
                 "block_at_a_time,rlp", "--preemption-orders", "latest_arrival_first,srtf"]) == 0
    assert "colocated:1 least_loaded block_at_a_time|rlp latest_arrival_first|srtf recompute" in capsys.readouterr().out


def test_a_group_that_is_not_every_combination_names_each_configuration():
    from kvmesh.sim.plan import Result, _label
    from kvmesh.sim.plan_search import Goodput

    def result(allocation, strategy):
        return Result(Candidate(Topology(colocated=1), "round_robin", "srtf", None, allocation, strategy),
                      Goodput(1.0, 2.0, ()))

    every = [result(a, s) for a in ("block_at_a_time", "rlp") for s in ("recompute", "swap")]
    assert _label(every) == "colocated:1 round_robin block_at_a_time|rlp srtf recompute|swap"
    assert _label(every[1:]) == ("colocated:1 round_robin block_at_a_time srtf swap; "
                                 "colocated:1 round_robin rlp srtf recompute; colocated:1 round_robin rlp srtf swap")


def test_the_simulator_refuses_a_searched_hook_among_the_fixed_policies():
    with pytest.raises(ValueError, match="the candidates name"):
        Simulator(Lengths.parse("64"), Lengths.parse("8"), 50, 0, {"ttft": 0.1}, EngineSpec(), StepCost(a=1e-3),
                  policies={"kv_allocation": "s3"})
