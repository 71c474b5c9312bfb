"""`kvmesh sim paper kvdirect`: the paper's experiment end to end through the CLI (the benchmark
contract's JSON and the plot), bad input refused before anything runs, and the headlines computed from
the points by the rules stated before the run (exact values on made-up figures)."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from kvmesh.bench.report import BenchResult
from kvmesh.cli import main
from kvmesh.sim import cluster
from kvmesh.sim.engine import EngineSpec
from kvmesh.sim.hardware import load_deployment
from kvmesh.sim.link import LinkSpec, pull
from kvmesh.sim.papers import kvdirect
from kvmesh.sim.papers.contract import Headline, result
from kvmesh.sim.papers.sweep import Outcome
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths, replay

CONTRACT = {"bench", "quick", "ratios", "targets", "directions", "meets", "ceilings", "config", "rows", "headline",
            "plots"}
HEADLINES = ("latency_reduction_arxiv", "latency_reduction_sharegpt", "vllm_tbt_growth", "vllm_ttft_growth",
             "transfer_share_arxiv", "transfer_share_sharegpt", "pull_speedup_over_push", "coalescing_speedup_arxiv",
             "coalescing_speedup_sharegpt")


def test_paper_kvdirect_quick_writes_the_contract_and_the_plot(tmp_path, capsys):
    out = tmp_path / "kvdirect.json"
    assert main(["sim", "paper", "kvdirect", "--quick", "--requests", "6", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    body = json.loads(out.read_text())
    assert set(body) == CONTRACT and body["bench"] == "sim paper kvdirect" and body["quick"] is True
    assert set(body["targets"]) == {f"{key}_factor" for key in HEADLINES}
    assert set(body["ratios"]) == set(body["targets"]) | {f"sim_{key}" for key in HEADLINES} | {
        f"sim_mean_latency_reduction_{workload}" for workload in kvdirect.WORKLOADS}
    assert set(body["directions"].values()) == {"<="} and set(body["targets"].values()) == {1.5}
    # Two rates, two workloads, four series: vLLM, KVDirect pulling, pushing, and without coalescing.
    assert len(body["rows"]) == 2 * 2 * 4
    assert {row["compared"] for row in body["rows"]} == {f"{w} {s}" for w in kvdirect.WORKLOADS for s in (
        kvdirect.VLLM, kvdirect.KVDIRECT, kvdirect.PUSH, kvdirect.UNCOALESCED)}
    assert all(row["cells"]["unfinished"] == 0 for row in body["rows"])
    assert body["config"]["profile"] == kvdirect.PROFILE and body["config"]["rates_per_engine"] == list(
        kvdirect.QUICK_RATES)
    # bench/report.py's BenchResult takes the body and judges the targets as the body does.
    ratios = {key: math.nan if value is None else value for key, value in body["ratios"].items()}
    judged = BenchResult(**{**{key: body[key] for key in CONTRACT - {"meets", "ratios"}}, "ratios": ratios})
    assert judged.meets == body["meets"]
    assert body["plots"] == [str(out.with_suffix(".png"))] and out.with_suffix(".png").stat().st_size > 0
    assert "P90 latency, KVDirect vs vLLM, arxiv" in printed and "simulated s per wall s" in printed


@pytest.mark.parametrize("argv, message", [
    (["nobody"], "unknown paper 'nobody'; papers: kvdirect"),
    (["kvdirect", "--rates", "0.1,x"], "rates '0.1,x'"),
    (["kvdirect", "--rates", "0.1,-0.2"], "rates '0.1,-0.2'"),
    (["kvdirect", "--rates", ""], "rates ''"),
    (["kvdirect", "--profile", "tiny-cpu-bfloat16-1t"], "not a GPU deployment"),
])
def test_paper_refuses_bad_input_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "paper.json"
    assert main(["sim", "paper", *argv, "--quick", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_a_headline_is_within_the_factor_only_on_the_published_side():
    assert Headline("k", "", 0.55, 0.44, "%").factor == pytest.approx(1.25)
    assert Headline("k", "", 2.2, 3.3, "x").factor == pytest.approx(1.5)
    assert math.isnan(Headline("k", "", 0.24, -0.01, "%").factor)
    assert math.isnan(Headline("k", "", 2.2, 0.9, "x").factor)
    assert math.isnan(Headline("k", "", 0.55, None, "%").factor)
    body = result("p", True, [Headline("a", "", 0.55, 0.44, "%"), Headline("b", "", 2.2, 1.2, "x")], [], {}, [])
    assert body["meets"] == {"a_factor": True, "b_factor": False}
    assert body["ratios"]["sim_a"] == 0.44
    assert body["headline"] == "p: 1 of 2 headlines within a factor of 1.5 of the paper's"


def test_the_headlines_follow_the_stated_rules():
    deployment = SimpleNamespace(engine_spec=lambda **overrides: EngineSpec(**overrides), link=LinkSpec())
    points = kvdirect.points(deployment, (0.1, 0.5), 10, 0, quick=True)
    # Made-up figures: vLLM's P90 latency 10 s at 0.1 and 20 s at 0.5, KVDirect's half of it (arxiv) or
    # 0.8 of it (sharegpt); pushing 1.2 times pulling; uncoalesced 1.1 times; transfer 1% and 3%.
    share = {"arxiv": 0.01, "sharegpt": 0.03}
    factor = {kvdirect.VLLM: 1.0, kvdirect.PUSH: 1.2, kvdirect.UNCOALESCED: 1.1, kvdirect.KVDIRECT: 1.0}

    def figures(point):
        vllm = 10.0 if point.rate == 0.1 else 20.0
        own = vllm if point.series == kvdirect.VLLM else vllm * (0.5 if point.workload == "arxiv" else 0.8)
        return {"e2e_p90_s": own * factor[point.series], "e2e_mean_s": 0.6 * own * factor[point.series],
                "tbt_p90_s": 0.05 * (1 if point.rate == 0.1 else 3),
                "ttft_p90_s": 1.0 * (1 if point.rate == 0.1 else 4), "transfer_share": share[point.workload]}

    outcomes = [Outcome(p, figures(p)) for p in points]
    assert kvdirect.also(outcomes) == pytest.approx({"sim_mean_latency_reduction_arxiv": 0.5,
                                                     "sim_mean_latency_reduction_sharegpt": 0.2})
    found = {h.key: h.simulated for h in kvdirect.headlines(outcomes)}
    assert found == pytest.approx({"latency_reduction_arxiv": 0.5, "latency_reduction_sharegpt": 0.2,
                                   "vllm_tbt_growth": 3.0, "vllm_ttft_growth": 4.0, "transfer_share_arxiv": 0.01,
                                   "transfer_share_sharegpt": 0.03, "pull_speedup_over_push": 0.2,
                                   "coalescing_speedup_arxiv": 0.1, "coalescing_speedup_sharegpt": 0.1})


def test_lognormal_lengths_have_the_mean_asked():
    lengths = Lengths.parse("lognormal:1000:0.5")
    assert lengths == Lengths("lognormal", 1000, sigma=0.5)
    assert np.mean(lengths.draw(np.random.default_rng(0), 200_000)) == pytest.approx(1000, rel=0.01)
    assert Lengths.parse("lognormal:7:0").draw(np.random.default_rng(0), 3) == [7, 7, 7]
    for bad in ("lognormal:1000", "lognormal:1000:-1", "lognormal:0:0.5"):
        with pytest.raises(ValueError, match="lognormal:MEAN:SIGMA|SIGMA >= 0"):
            Lengths.parse(bad)


def test_the_paged_attention_variation_alone_reads_the_kv_at_vllms_paged_attention_share(monkeypatch):
    deployment = load_deployment(kvdirect.PROFILE)
    points = kvdirect.points(deployment, (0.1,), 4, 0, quick=False)
    varied = [p for p in points if p.variant == kvdirect.PAGED_ATTENTION]
    assert {(p.workload, p.series) for p in varied} == {(w, s) for w in kvdirect.WORKLOADS
                                                        for s in (kvdirect.VLLM, kvdirect.KVDIRECT)}
    seen = []
    monkeypatch.setattr(kvdirect.sweep, "simulate", lambda point, cost, geometry: seen.append(cost))
    kvdirect.simulate(varied[0], deployment.cost, deployment.geometry)
    kvdirect.simulate(points[0], deployment.cost, deployment.geometry)
    assert seen[0].gpu.decode_attention_efficiency == kvdirect.PAGED_ATTENTION_EFFICIENCY == 0.28
    assert seen[1] is deployment.cost and deployment.cost.gpu.decode_attention_efficiency == 0.767
    # Only the decodes' KV read is slower: 0.767 / 0.28 of the profile's time for it.
    extra = seen[0].seconds(0, 13, 858_637, 0) - deployment.cost.seconds(0, 13, 858_637, 0)
    kv_s = deployment.cost.kv_bytes_per_token_per_gpu / (3350e9 * 0.767)
    assert extra == pytest.approx(858_637 * kv_s * (0.767 / 0.28 - 1), rel=1e-9)


def _stall(spec: EngineSpec) -> float:
    """The longest gap between two tokens of a running request while a 40,960-token prompt arrives, on
    one vLLM engine of the deployment with `spec`."""
    deployment = load_deployment(kvdirect.PROFILE)
    running, arriving = replay([0.0, 1.0], [1_000, 40_960], [200, 2])
    cluster.build(Topology.parse("colocated:1"), spec, deployment.cost, geometry=deployment.geometry).run(
        [running, arriving])
    return float(np.max(np.diff(running.token_times)))


def test_the_engines_prefill_whole_prompts_and_vllm_0_5_3s_chunks_of_512_are_a_variation():
    deployment = load_deployment(kvdirect.PROFILE)
    points = kvdirect.points(deployment, (0.1,), 4, 0, quick=False)
    own = {(p.spec.chunked_prefill, p.spec.token_budget) for p in points if p.variant != kvdirect.CHUNKED}
    chunked = [p for p in points if p.variant == kvdirect.CHUNKED]
    assert own == {(False, kvdirect.MAX_CONTEXT)}
    assert {(p.spec.chunked_prefill, p.spec.token_budget) for p in chunked} == {(True, 512)}
    assert {(p.workload, p.series) for p in chunked} == {(w, s) for w in kvdirect.WORKLOADS
                                                         for s in (kvdirect.VLLM, kvdirect.KVDIRECT)}
    # Whole prompts: the running request waits out the prompt's whole prefill (3.1 s in the roofline);
    # chunks of 512: a step of one chunk and its decode at most.
    whole, chunks = _stall(points[0].spec), _stall(chunked[0].spec)
    assert whole >= deployment.cost.seconds(40_960, 0, 0, 40_960 * 40_961 // 2) > 3.0
    assert chunks <= deployment.cost.seconds(512, 1, 41_160, 512 * 40_960) < 0.1


def test_kvdirects_pull_reads_k_and_v_apart_two_reads_a_block_and_layer_without_coalescing():
    deployment = load_deployment(kvdirect.PROFILE)
    geometry = deployment.geometry
    assert geometry.block_bytes(1) * geometry.num_layers == 352 * 1024  # a token's KV, all GPUs (Sec. 5.1)
    links = {p.series: p.link for p in kvdirect.points(deployment, (0.1,), 4, 0, quick=True)}
    uncoalesced, coalesced = (pull(links[name], geometry, 16, 40_960) for name in (kvdirect.UNCOALESCED,
                                                                                      kvdirect.KVDIRECT))
    assert (uncoalesced.reads, coalesced.reads) == (2 * 88 * 2_560, 2 * 88)
    assert uncoalesced.bytes == coalesced.bytes == 40_960 * 352 * 1024
    # Each GPU posts that many reads on its own NIC, all eight at once.
    extra_s = 2 * 88 * 2_560 * kvdirect.UNCOALESCED_READ_US * 1e-6
    assert uncoalesced.data_s - coalesced.data_s == pytest.approx(extra_s)


def test_the_rates_and_the_link_are_varied():
    deployment = load_deployment(kvdirect.PROFILE)
    points = kvdirect.points(deployment, (0.1,), 4, 0, quick=False)
    assert {p.rate for p in points if p.variant == kvdirect.LOW} == set(kvdirect.LOW_RATES)
    assert {(p.rate, p.step_overhead_s) for p in points if p.variant == kvdirect.LOW_SLOW} == {
        (rate, 0.025) for rate in kvdirect.LOW_RATES}
    assert [p.link.gbps for p in points if p.variant == kvdirect.ONE_NIC] == pytest.approx([22.23] * 2)
    assert {p.link.gbps for p in points if p.variant == kvdirect.LINE_RATE} == {8 * 50.0}
    assert deployment.link.gbps == pytest.approx(8 * 22.23)
