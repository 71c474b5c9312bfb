"""`kvmesh sim paper car`: CaR's experiment end to end through the CLI (the benchmark contract's JSON and
the plot), its headlines computed by the rules stated before the run (exact values on made-up
figures), and the conversations it runs: each turn's prompt and blocks extend the turn before."""

import json
import math
from types import SimpleNamespace

import pytest

from kvmesh.bench.report import BenchResult
from kvmesh.cli import main
from kvmesh.sim.conversations import Conversations, conversations, turn
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.papers import car
from kvmesh.sim.papers.sweep import Outcome
from kvmesh.sim.workload import Lengths

CONTRACT = {"bench", "quick", "ratios", "targets", "directions", "meets", "ceilings", "config", "rows", "headline",
            "plots"}
HEADLINES = ("ttft_reduction", "ttft_reduction_long_context")


def test_paper_car_quick_writes_the_contract_and_the_plot(tmp_path, capsys):
    out = tmp_path / "car.json"
    assert main(["sim", "paper", "car", "--quick", "--requests", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    body = json.loads(out.read_text())
    assert set(body) == CONTRACT and body["bench"] == "sim paper car" and body["quick"] is True
    assert set(body["targets"]) == {f"{key}_factor" for key in HEADLINES}
    assert {f"sim_{key}" for key in HEADLINES} | {"sim_ttft_reduction_car_vs_lru"} <= set(body["ratios"])
    # Two history lengths, three series: recompute, the device-only LRU cache, CaR.
    assert sorted(row["compared"] for row in body["rows"]) == sorted(["chat recompute", "chat lru", "chat car"] * 2)
    assert all(row["cells"]["unfinished"] == 0 for row in body["rows"])
    assert body["config"]["profile"] == car.PROFILE
    ratios = {key: math.nan if value is None else value for key, value in body["ratios"].items()}
    judged = BenchResult(**{**{key: body[key] for key in CONTRACT - {"meets", "ratios"}}, "ratios": ratios})
    assert judged.meets == body["meets"]
    assert body["plots"] == [str(out.with_suffix(".png"))] and out.with_suffix(".png").stat().st_size > 0
    assert "TTFT with reuse vs recomputation" in printed and "simulated s per wall s" in printed


def test_the_headlines_follow_the_stated_rules():
    deployment = SimpleNamespace(engine_spec=lambda **overrides: EngineSpec(**overrides, block_bytes=1),
                                 geometry=SimpleNamespace(num_layers=2))
    points = car.points(deployment, (1.0,), 8, 0, quick=True)
    # Made-up figures: recompute's mean TTFT of the history turns 1 s at 512 tokens and 2 s at 1792;
    # LRU's 0.8 of it, CaR's 0.6 (512) and 0.3 (1792).
    share = {car.RECOMPUTE: 1.0, car.LRU: 0.8, car.CAR: None}

    def figures(point):
        base = 1.0 if point.history == 512 else 2.0
        own = share[point.series] or (0.6 if point.history == 512 else 0.3)
        return {"ttft_history_mean_s": base * own, "cached_share": 0.5}

    outcomes = [Outcome(p, figures(p)) for p in points]
    found = {h.key: h.simulated for h in car.headlines(outcomes)}
    assert found == pytest.approx({"ttft_reduction": (0.4 + 0.7) / 2, "ttft_reduction_long_context": 0.7})
    also = car.also(outcomes)
    assert also["sim_ttft_reduction_car_vs_lru"] == pytest.approx((0.25 + 0.625) / 2)
    assert also["sim_ttft_reduction_lru_vs_recompute_longest"] == pytest.approx(0.2)


def test_each_turn_extends_the_conversation_before_it():
    shape = Conversations(rate=0.5, turns=3, history=40, message=Lengths("fixed", 5), output=Lengths("fixed", 7),
                          think_s=10.0, max_context=2048)
    requests = conversations(shape, 7, block_size=16, seed=1)
    assert len(requests) == 7 and [r.arrival for r in requests] == sorted(r.arrival for r in requests)
    first = {r.request_id: r for r in requests}
    assert [first[f"c0t{k}"].prompt_len for k in range(3)] == [40, 40 + 7 + 5, 40 + 2 * (7 + 5)]
    assert [turn(first[f"c0t{k}"]) for k in range(3)] == [0, 1, 2]
    t0, t1 = first["c0t0"], first["c0t1"]
    assert t0.block_names == ("c0:0", "c0:1") and t1.block_names[:2] == t0.block_names
    assert len(t1.block_names) == (52 + 7) // 16 and t1.arrival > t0.arrival
    assert first["c1t0"].block_names[0] == "c1:0"   # conversations share nothing


def test_a_conversation_stops_at_the_context_window():
    shape = Conversations(rate=1.0, turns=5, history=30, message=Lengths("fixed", 10), output=Lengths("fixed", 10),
                          think_s=1.0, max_context=64)
    requests = conversations(shape, 4, block_size=16, seed=0)
    c0 = [r for r in requests if r.request_id.startswith("c0t")]
    assert [(r.prompt_len, r.max_tokens) for r in c0] == [(30, 10), (50, 10)]
    assert all(r.prompt_len + r.max_tokens <= 64 for r in requests)
