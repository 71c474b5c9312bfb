"""`kvmesh plan` and `kvmesh sim run` on conversations: the prefix cache (none, lru, car) and
prefix_aware routing are searched where requests share blocks, pruned where they cannot matter, the
rate counts conversations started, and what the cache gave is reported."""

import itertools
import json

import pytest

from kvmesh.cli import main
from kvmesh.sim.plan_search import ROUTINGS, Candidate, cache_choices, routing_choices, search_space
from kvmesh.sim.topology import Topology

# Every dimension but the cache and the routing pinned: a dimension the planner searches by default
# (the front door doubled this search) must not grow this test (test_plan_front_door.py runs
# conversations behind the door).
CONVERSATIONS = ["--rate", "2", "--requests", "120", "--prompt", "uniform:32-96", "--output", "exp:32",
                 "--turns", "4", "--system-prompt", "256", "--think-s", "0.5", "--slo", "ttft=200",
                 "--slo", "tpot=20", "--engines", "2", "--routing", "least_loaded,prefix_aware",
                 "--transfer-modes", "pull", "--kv-allocations", "block_at_a_time",
                 "--preemption-orders", "latest_arrival_first", "--front-doors", "off", "--layer-offloads", "none",
                 "--device-blocks", "1024"]
HOOKS = {"kv_allocation": ["block_at_a_time"], "preemption_order": ["latest_arrival_first"],
         "preemption_strategy": ["recompute"]}


def test_plan_searches_the_prefix_cache_and_prefix_aware_routing_on_conversations(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *CONVERSATIONS, "--cxl-blocks", "4096", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    body = json.loads(out.read_text())
    assert body["config"]["workload"]["kind"] == "conversations" and body["config"]["workload"]["turns"] == 4
    assert body["config"]["search"]["caches"] == ["none", "lru", "car"]
    found = sorted((r["topology"], r["routing"], r["cache"]) for r in body["results"])
    searched = itertools.product(("colocated:2", "pd:1:1"), ("least_loaded", "prefix_aware"), ("none", "lru", "car"))
    assert found == sorted(list(searched) * 3)  # each with the 3 preemption strategies (a cxl tier)
    for r in body["results"]:
        cache = r["probes"][0]["cache"]
        if r["cache"] == "none":
            assert cache is None
        else:  # a system prompt and earlier turns: most of a prompt is found
            assert cache["lookup_blocks"] > 0 and cache["prompt_tokens_cached"] > 0.3
            assert 0 < cache["hit_rate_device"] + cache["hit_rate_cxl"] <= 1
            assert cache["nodes_to_cxl"] == 0 or r["cache"] == "car"  # only CaR moves nodes out
    assert "conv/s" in printed and "prompt cached" in printed
    assert body["pick"]["winner"]["cache"] in ("lru", "car")
    # 30 conversations of 4 turns 0.5 s apart: their starts last under 3 lives (6 s) at the goodput
    assert "3x a conversation's life (4 think times)" in body["pick"]["short_horizon"]


def test_plan_on_lone_requests_searches_no_cache_and_the_routings_it_did():
    assert routing_choices(None, shares_blocks=False) == list(ROUTINGS)
    assert routing_choices(None, shares_blocks=True) == [*ROUTINGS, "prefix_aware"]
    assert routing_choices(["round_robin"], shares_blocks=True) == ["round_robin"]
    space = search_space([2], ["colocated", "pd"], ["least_loaded"], ["pull"], HOOKS,
                         cache_choices(["none", "lru", "car"], shares_blocks=False, cxl_tier=True))
    assert [c.cache for c in space] == [None, None]
    assert str(space[0]) == "colocated:2 least_loaded block_at_a_time latest_arrival_first recompute"


def test_the_cache_is_pruned_where_it_cannot_matter():
    assert cache_choices(["none", "lru", "car"], shares_blocks=True, cxl_tier=False) == ["none", "lru"]
    assert cache_choices(["none", "lru", "car"], shares_blocks=True, cxl_tier=True) == ["none", "lru", "car"]
    with pytest.raises(ValueError, match="nope"):
        cache_choices(["nope"], shares_blocks=True, cxl_tier=True)
    space = search_space([2], ["colocated", "pd"], ["least_loaded"], ["pull", "push"], HOOKS, ["none", "lru"])
    assert [(str(c.topology), c.transfer_mode, c.cache) for c in space] == [
        ("colocated:2", None, "none"), ("colocated:2", None, "lru"), ("pd:1:1", "pull", "none"),
        ("pd:1:1", "pull", "lru"), ("pd:1:1", "push", "none"), ("pd:1:1", "push", "lru")]
    assert str(Candidate(Topology(colocated=2), "prefix_aware", "srtf", cache="car")) == \
        "colocated:2 prefix_aware cache:car block_at_a_time srtf recompute"


@pytest.mark.parametrize("argv, message", [
    (["--caches", "nope"], "nope"),
    (["--caches", "car"], "search space is empty"),          # car without a cxl tier: nothing left
    (["--system-prompt", "5000"], "--max-context"),
])
def test_plan_refuses_bad_conversations_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "plan.json"
    assert main(["plan", *CONVERSATIONS, *argv, "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == "" and not out.exists()


def test_sim_run_serves_conversations_with_a_prefix_cache(tmp_path, capsys):
    out, lone = tmp_path / "run.json", tmp_path / "lone.json"
    assert main(["sim", "run", "--rate", "2", "--requests", "60", "--turns", "3", "--system-prompt", "128",
                 "--cache", "lru", "--topology", "colocated:2", "--routing", "prefix_aware", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert body["config"]["conversations"]["turns"] == 3 and body["config"]["cache"] == "lru"
    assert body["results"]["requests"] == 60 and body["results"]["cache"]["prompt_tokens_cached"] > 0
    assert "prompt tokens cached" in capsys.readouterr().out
    assert main(["sim", "run", "--rate", "2", "--requests", "20", "--json", str(lone)]) == 0
    body = json.loads(lone.read_text())
    assert body["config"]["conversations"] is None and body["results"]["cache"] is None
