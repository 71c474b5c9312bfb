"""`kvmesh sim paper layerkv`: the paper's experiment end to end through the CLI (the benchmark
contract's JSON and the plot), and the headlines computed from the points by the rules stated before
the run (exact values on made-up figures)."""

import json
import math

import pytest

from kvmesh.bench.report import BenchResult
from kvmesh.cli import main
from kvmesh.sim.hardware import load_deployment
from kvmesh.sim.papers import layerkv
from kvmesh.sim.papers.sweep import Outcome

CONTRACT = {"bench", "quick", "ratios", "targets", "directions", "meets", "ceilings", "config", "rows", "headline",
            "plots"}
HEADLINES = ("ttft_gain_longest_context", "ttft_gain_sharegpt", "p99_ttft_gain_sharegpt", "slo_violation_drop")


def test_paper_layerkv_quick_writes_the_contract_and_the_plot(tmp_path, capsys):
    out = tmp_path / "layerkv.json"
    assert main(["sim", "paper", "layerkv", "--quick", "--requests", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    body = json.loads(out.read_text())
    assert set(body) == CONTRACT and body["bench"] == "sim paper layerkv" and body["quick"] is True
    assert set(body["targets"]) == {f"{key}_factor" for key in HEADLINES}
    assert {f"sim_{key}" for key in HEADLINES} | {"sim_throughput_ratio_llama-2-7b",
                                                  "sim_throughput_ratio_sharegpt"} <= set(body["ratios"])
    # Two contexts of Llama-2-7B with vLLM and LayerKV, one ShareGPT rate with those and LayerKV without Algorithm 1.
    assert sorted(row["compared"] for row in body["rows"]) == sorted(
        ["llama-2-7b vllm", "llama-2-7b layerkv"] * 2 + ["sharegpt vllm", "sharegpt layerkv", "sharegpt layerkv-noslo"])
    assert all(row["cells"]["unfinished"] == 0 for row in body["rows"])
    ratios = {key: math.nan if value is None else value for key, value in body["ratios"].items()}
    judged = BenchResult(**{**{key: body[key] for key in CONTRACT - {"meets", "ratios"}}, "ratios": ratios})
    assert judged.meets == body["meets"]
    assert body["plots"] == [str(out.with_suffix(".png"))] and out.with_suffix(".png").stat().st_size > 0
    assert "mean TTFT, vLLM over LayerKV" in printed and "simulated s per wall s" in printed


def test_layerkv_runs_on_a_staging_area_and_the_host_tier():
    deployment = load_deployment(layerkv.PROFILE)
    vllm, ours = layerkv.engine_spec(deployment, False), layerkv.engine_spec(deployment, True)
    assert vllm.device_blocks == ours.device_blocks and not vllm.cxl_blocks and not vllm.staging_cap
    assert ours.staging_cap == ours.device_blocks // 4 and ours.offload.threshold_blocks == ours.device_blocks // 10
    assert ours.cxl_blocks * ours.block_bytes == pytest.approx(256 * 2**30, rel=1e-4)  # a GPU's share of the host
    assert ours.swap_in_bytes_per_s == 25e9 and ours.prefill_cost is not None and ours.offload_cost is not None
    halved = layerkv.engine_spec(deployment, True, layerkv.VARIANTS[0])
    assert halved.device_blocks == ours.device_blocks // 2


def test_the_headlines_follow_the_stated_rules():
    points = layerkv.points(load_deployment(layerkv.PROFILE), (5.0, 6.0), 4, 0, quick=True)
    # Made-up figures: vLLM's mean TTFT 10 s at 2,048 tokens and 40 s at 8,192, LayerKV's 2 s and 5 s; on
    # ShareGPT vLLM's mean 3 s, P99 9 s and violations 40% at both rates, LayerKV's 1 s, 1 s and 20% at 5,
    # 0.5 s, 3 s and 30% at 6; without Algorithm 1 violations of 50% at 5 and 10% at 6.
    context = {("vllm", 2048): 10.0, ("vllm", 8192): 40.0, ("layerkv", 2048): 2.0, ("layerkv", 8192): 5.0}
    sharegpt = {("vllm", 5.0): (3, 9, 0.4), ("vllm", 6.0): (3, 9, 0.4), ("layerkv", 5.0): (1, 1, 0.2),
                ("layerkv", 6.0): (0.5, 3, 0.3), ("layerkv-noslo", 5.0): (1, 1, 0.5),
                ("layerkv-noslo", 6.0): (1, 1, 0.1)}

    def figures(point):
        if point.workload == "sharegpt":
            mean, p99, violations = sharegpt[point.series, point.rate]
            return {"ttft_mean_s": mean, "ttft_p99_s": p99, "slo_violation": violations, "throughput_tok_s": 100.0,
                    "tpot_violation": 0.0}
        return {"ttft_mean_s": context[point.series, point.prompt.low], "throughput_tok_s": 50.0}

    outcomes = [Outcome(p, figures(p)) for p in points]
    found = {h.key: h.simulated for h in layerkv.headlines(outcomes)}
    assert found == pytest.approx({"ttft_gain_longest_context": 8.0, "ttft_gain_sharegpt": 6.0,
                                   "p99_ttft_gain_sharegpt": 9.0, "slo_violation_drop": 0.2})
    extra = layerkv.also(outcomes)
    assert extra["sim_noslo_violation_drop_at_5"] == pytest.approx(-0.1)
    assert extra["sim_noslo_violation_drop_at_6"] == pytest.approx(0.3)
    assert extra["sim_throughput_ratio_llama-2-7b"] == extra["sim_throughput_ratio_sharegpt"] == 1.0
