"""`kvmesh sim paper cacheopt`: the paper's experiment end to end through the CLI (the benchmark
contract's JSON and the plot, in two stages: the baselines, then CacheOpt with the SLOs they set), and
its pure parts with exact values: Table 1's shapes, the predictor's error range, each method's
estimated length (Eq. 3-4, RLP, S^3, /CKA), Figure 17's settings, the SLOs and attainment, and the
headlines' rules."""

import json
import math
from dataclasses import replace
from statistics import NormalDist

import numpy as np
import pytest

from kvmesh.bench.report import BenchResult
from kvmesh.cli import main
from kvmesh.policies.length.padding import Direction
from kvmesh.sim.hardware import load_deployment
from kvmesh.sim.papers import cacheopt
from kvmesh.sim.papers.predicted_lengths import Confidence, PredictorModel, Shape, estimated
from kvmesh.sim.papers.sweep import Outcome

CONTRACT = {"bench", "quick", "ratios", "targets", "directions", "meets", "ceilings", "config", "rows", "headline",
            "plots"}


def test_paper_cacheopt_quick_writes_the_contract_and_the_plot(tmp_path, capsys):
    out = tmp_path / "cacheopt.json"
    assert main(["sim", "paper", "cacheopt", "--quick", "--requests", "6", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    body = json.loads(out.read_text())
    assert set(body) == CONTRACT and body["bench"] == "sim paper cacheopt" and body["quick"] is True
    keys = {h.key for h in cacheopt.headlines_at({}, {}, {})}
    assert len(keys) == 8 + 2 + 2 + 2 + 12 and set(body["targets"]) == {f"{key}_factor" for key in keys}
    assert {f"sim_{key}" for key in keys} <= set(body["ratios"])
    # Three traces at two rates: the four baselines first, then CacheOpt, then its six ablations at 1.0.
    assert len(body["rows"]) == 3 * 2 * 4 + 3 * 2 + 3 * 6
    assert [row["compared"] for row in body["rows"][:4]] == ["alpaca vllm", "alpaca rlp", "alpaca s3",
                                                             "alpaca sarathi"]
    assert {row["compared"] for row in body["rows"][-18:]} == {f"{w} {a} (ablation)" for w in cacheopt.TRACES
                                                               for a in cacheopt.ABLATIONS}
    assert all(row["cells"]["unfinished"] == 0 for row in body["rows"])
    ratios = {key: math.nan if value is None else value for key, value in body["ratios"].items()}
    judged = BenchResult(**{**{key: body[key] for key in CONTRACT - {"meets", "ratios"}}, "ratios": ratios})
    assert judged.meets == body["meets"]
    assert body["plots"] == [str(out.with_suffix(".png"))] and out.with_suffix(".png").stat().st_size > 0
    assert "P99 TBT, sarathi over CacheOpt" in printed and "slo_ttft_ms_sharegpt" in printed


def test_a_shape_reaches_the_farther_extreme_of_table_1():
    z = NormalDist().inv_cdf(1 - 1 / 90_000)
    out = Shape(337.99, 19, 991, 90_000)  # ShareGPT's output: its min is the farther end
    assert z * out.sigma + out.sigma ** 2 / 2 == pytest.approx(math.log(337.99 / 19))
    prompt = Shape(19.31, 9, 2_470, 52_000)  # Alpaca's input: its max is
    z = NormalDist().inv_cdf(1 - 1 / 52_000)
    assert z * prompt.sigma - prompt.sigma ** 2 / 2 == pytest.approx(math.log(2_470 / 19.31))
    drawn = out.draw(np.random.default_rng(0), 10_000)
    assert drawn.min() >= 19 and drawn.max() == 991 and abs(drawn.mean() - 337.99) < 0.05 * 337.99


def test_each_method_estimates_by_its_rule():
    predicted, under, over = np.array([100]), [Direction.UNDER], [Direction.OVER]
    interval = (-60.0, 40.0)  # the predictor's errors, actual - predicted: (b - a) = 100 tokens
    c = 0.9 / (1 + 100 * 28 / 1e3)  # Eq. 4 at 28 req/s, lambda per ms
    t = math.sqrt(-100 ** 2 / 2 * math.log(1 - c))  # Eq. 3: 36.8 tokens
    assert estimated("cacheopt", predicted, under, [1000], 28.0, interval) == [math.ceil(100 + t)] == [137]
    assert estimated("cacheopt", predicted, over, [1000], 28.0, interval) == [math.ceil(100 - t)] == [64]
    assert estimated("rlp", predicted, over, [1000], 28.0, interval) == [200]
    assert estimated("rlp", predicted, over, [150], 28.0, interval) == [150]
    assert estimated("s3", predicted, over, [1000], 28.0, interval) == [150]
    assert estimated("cka", predicted, over, [1000], 28.0, interval) == [110]
    assert estimated("none", predicted, over, [1000], 28.0, interval) == [None]
    exact, directions = PredictorModel(0.0, 1.0).predict(np.random.default_rng(0), np.array([5, 300]))
    assert exact.tolist() == [5, 300] and directions == [Direction.OVER, Direction.OVER]


def test_the_error_interval_is_the_predictors_measured_errors_on_held_out_requests():
    held_out = np.full(10_000, 200)
    # Exact predictions miss by nothing: no range, no padding.
    assert PredictorModel(0.0, 1.0).error_interval(np.random.default_rng(0), held_out) == (0.0, 0.0)
    # Otherwise the central 90% of actual - predicted, in tokens, with predicted = 200 e^e, e ~ N(0, 0.5):
    # 200 (1 - e^(+-1.645 * 0.5)), about -255 and 112 tokens.
    a, b = PredictorModel(0.5).error_interval(np.random.default_rng(0), held_out)
    z = NormalDist().inv_cdf(0.95) * 0.5
    assert a == pytest.approx(200 * (1 - math.exp(z)), abs=6) and b == pytest.approx(200 * (1 - math.exp(-z)), abs=3)
    # The points measure it on the trace's held-out requests, the same for every rate and method.
    deployment = load_deployment(cacheopt.PROFILE)
    own = cacheopt.requests(cacheopt._point(deployment, cacheopt.CACHEOPT, "sharegpt", 1.0, 50, 3, slo=(1e3, 40.0)))
    half = cacheopt.requests(cacheopt._point(deployment, cacheopt.CACHEOPT, "sharegpt", 0.5, 50, 3, slo=(1e3, 40.0)))
    predicted, directions = PredictorModel().predict(np.random.default_rng([3, 1, 2]),
                                                     np.array([r.max_tokens for r in own]))
    holding = np.random.default_rng([3, 1, 4])
    interval = PredictorModel().error_interval(holding, cacheopt.TRACES["sharegpt"].output.draw(holding, 1000))
    assert [r.predicted_output_len for r in own] == estimated("cacheopt", predicted, directions, [r.cap for r in own],
                                                              28.0, interval)
    assert [r.max_tokens for r in half] == [r.max_tokens for r in own]


def test_requests_carry_the_same_lengths_and_predictions_for_every_method_and_slos_by_their_scale():
    deployment = load_deployment(cacheopt.PROFILE)
    vllm = cacheopt._point(deployment, cacheopt.VLLM, "sharegpt", 0.5, 50, 3)
    ours = cacheopt._point(deployment, cacheopt.CACHEOPT, "sharegpt", 1.0, 50, 3, slo=(1000.0, 40.0))
    a, b = cacheopt.requests(vllm), cacheopt.requests(ours)
    assert [(r.prompt_len, r.max_tokens, r.cap) for r in a] == [(r.prompt_len, r.max_tokens, r.cap) for r in b]
    assert b[-1].arrival == pytest.approx(a[-1].arrival / 2)  # twice the rate, the same gaps halved
    assert all(r.predicted_output_len is None and r.ttft_slo_ms is None for r in a)
    assert all(r.ttft_slo_ms == pytest.approx(1000.0 * r.slo_scale * r.chunks) and
               r.tbt_slo_ms == pytest.approx(40.0 * r.slo_scale) and 0.5 <= r.slo_scale <= 2.5 for r in b)
    # Figure 17's settings: every request's SLO at one scale; CacheOpt's B, m or reservation.
    fixed = cacheopt._point(deployment, cacheopt.CACHEOPT, "sharegpt", 1.0, 50, 3, "Fig. 17a SLO scale 0.5",
                            (1000.0, 40.0))
    assert {(r.slo_scale, r.tbt_slo_ms) for r in cacheopt.requests(fixed)} == {(0.5, 20.0)}
    assert cacheopt._point(deployment, cacheopt.CACHEOPT, "sharegpt", 1.0, 50, 3, "Fig. 17c m 3").allocation == \
        replace(cacheopt.METHODS[cacheopt.CACHEOPT][1], proactive_iterations=3)
    # The policies see the trace's longest output (within the context) as max_tokens, not the length.
    r = max(b, key=lambda r: r.cap - r.max_tokens)
    assert r.view().max_tokens == r.cap == min(991, cacheopt.MAX_CONTEXT - r.prompt_len) > r.max_tokens


def test_slos_and_attainment_follow_section_5():
    def outcome(series, workload, ttft_sum, gap_sum, variant=""):
        point = replace(cacheopt._point(load_deployment(cacheopt.PROFILE), series, workload, 1.0, 4, 0),
                        variant=variant)
        return Outcome(point, {"ttft_sum_s": ttft_sum, "ttft_count": 4, "gap_sum_s": gap_sum, "gap_count": 10})

    found = [outcome("vllm", "alpaca", 4.0, 0.5), outcome("s3", "alpaca", 8.0, 1.5),
             outcome("cacheopt", "alpaca", 100.0, 100.0), outcome("rlp", "alpaca", 100.0, 100.0, "exact predictions")]
    assert cacheopt.slo_unit_ms(found, "alpaca") == pytest.approx((1500.0, 100.0))
    figures = {"ttft_per_slo_unit": [1.0, 2.0, math.inf, 0.5], "gap_per_slo_unit": [0.05, 0.05, math.inf, 0.2],
               "mean_gap_per_slo_unit": [0.05, 0.05, math.inf, 0.05]}
    assert cacheopt.attainment(figures, (1500.0, 100.0)) == {"ttft": 0.5, "tbt": 0.5, "both": 0.25}
    assert cacheopt.attainment(figures, (1500.0, 100.0), "mean_gap_per_slo_unit")["tbt"] == 0.75


def test_the_headlines_follow_the_stated_rules():
    # Made-up figures: at each rate every trace has the same P99s; vLLM's P99 TBT is 3x CacheOpt's at 1.0
    # and 2x at 0.5, RLP's P99 TTFT twice CacheOpt's; each ablation's P99s are CacheOpt's over 0.6. 9 in
    # 10 requests meet their TTFT SLO, but for Sarathi at 1.0 (6 in 10), whose latency is 1.5x CacheOpt's.
    everyone = {"ttft_per_slo_unit": [0.0] * 9 + [math.inf], "gap_per_slo_unit": [0.0] * 10}

    def figures(series, load):
        tbt = {cacheopt.VLLM: 3.0 if load == 1.0 else 2.0}.get(series, 1.0)
        ttft = {cacheopt.RLP: 2.0}.get(series, 1.0)
        latency = {cacheopt.VLLM: 1.0 if load == 0.5 else 3.0, cacheopt.SARATHI: 1.5}.get(series, 1.0)
        met = {"ttft_per_slo_unit": [0.0] * 6 + [math.inf] * 4} if (series, load) == (cacheopt.SARATHI, 1.0) else {}
        return everyone | met | {"tbt_p99_s": tbt, "ttft_p99_s": ttft, "normalised_latency_s": latency}

    at = {(w, s, load): figures(s, load) for w in cacheopt.TRACES for s in (*cacheopt.BASELINES, cacheopt.CACHEOPT)
          for load in (0.5, 1.0)}
    ablated = {(w, a, 1.0): {"tbt_p99_s": 1 / 0.6, "ttft_p99_s": 1 / 0.6} for w in cacheopt.TRACES
               for a in cacheopt.ABLATIONS}
    found = {h.key: h.simulated for h in cacheopt.headlines_at(at, ablated, dict.fromkeys(cacheopt.TRACES, (1.0, 1.0)))}
    assert found["p99_tbt_vllm_over_cacheopt"] == pytest.approx(3.0)
    assert found["p99_ttft_rlp_over_cacheopt"] == pytest.approx(2.0) and found["p99_tbt_s3_over_cacheopt"] == 1.0
    assert found["ttft_slo_attainment_cacheopt"] == pytest.approx(0.9) and found["tbt_slo_attainment_cacheopt"] == 1.0
    assert found["sustained_rate_cacheopt_over_vllm"] == pytest.approx(2.0)  # vLLM's latency 3x its own at 1.0
    assert found["sustained_rate_cacheopt_over_sarathi"] == 1.0  # within 2x vLLM's lowest at both rates
    assert found["ttft_slo_attainment_gain_over_sarathi"] == pytest.approx(0.9 / 0.6 - 1)
    assert found["tbt_slo_attainment_gain_over_sarathi"] == 0.0
    assert found["p99_ttft_reduction_vs_pss"] == pytest.approx(0.4) and found["p99_tbt_reduction_vs_cka"] == \
        pytest.approx(0.4)


def test_figure_17e_to_g_set_eq_4s_alpha_and_beta_or_a_fixed_confidence_per_point():
    deployment = load_deployment(cacheopt.PROFILE)

    def confidence(variant):
        return cacheopt._point(deployment, cacheopt.CACHEOPT, "sharegpt", 1.0, 50, 3, variant, (1000.0, 40.0)).confidence

    assert confidence("") == Confidence(0.9, 100.0, None)
    assert [confidence(f"Fig. 17e alpha {a}") for a in ("0.5", "0.7", "0.99")] == \
        [Confidence(0.5, 100.0), Confidence(0.7, 100.0), Confidence(0.99, 100.0)]
    assert [confidence(f"Fig. 17f beta {b}") for b in (10, 50, 200)] == \
        [Confidence(0.9, 10.0), Confidence(0.9, 50.0), Confidence(0.9, 200.0)]
    assert [confidence(f"Fig. 17g confidence {c}") for c in ("0.8", "0.85", "0.9", "0.95")] == \
        [Confidence(fixed=c) for c in (0.8, 0.85, 0.9, 0.95)]
    # Eq. 4 at ShareGPT's 28 req/s, lambda per ms; a fixed confidence whatever the rate.
    assert Confidence().at(28.0) == pytest.approx(0.9 / 3.8)
    assert Confidence(0.5, 100.0).at(28.0) == pytest.approx(0.5 / 3.8)
    assert Confidence(0.9, 10.0).at(28.0) == pytest.approx(0.9 / 1.28)
    assert Confidence(0.9, 200.0).at(1.2) == pytest.approx(0.9 / 1.24)
    assert Confidence(fixed=0.8).at(28.0) == Confidence(fixed=0.8).at(1.2) == 0.8
    # The padding follows: Eq. 3 at c = 0.8 for a request predicted at 100 tokens.
    t = math.sqrt(-100 ** 2 / 2 * math.log(1 - 0.8))  # (b - a) = 100 tokens: 89.7
    assert estimated("cacheopt", np.array([100]), [Direction.UNDER], [1000], 28.0, (-50.0, 50.0),
                     Confidence(fixed=0.8)) == [math.ceil(100 + t)] == [190]
    # Only CacheOpt's estimates move; its lengths and every other method's estimates stay.
    fixed, own = (cacheopt._point(deployment, cacheopt.CACHEOPT, "sharegpt", 1.0, 50, 3, v, (1000.0, 40.0))
                  for v in ("Fig. 17g confidence 0.95", ""))
    higher, lower = cacheopt.requests(fixed), cacheopt.requests(own)
    assert [r.max_tokens for r in higher] == [r.max_tokens for r in lower]
    assert sum(abs(r.predicted_output_len - r.max_tokens) for r in higher) != \
        sum(abs(r.predicted_output_len - r.max_tokens) for r in lower)


def test_figure_17h_counts_over_and_under_provisioned_requests():
    requests = [cacheopt.TraceRequest(f"r{i}", 0.0, 10, length, None, None, estimate)
                for i, (length, estimate) in enumerate(((100, 130), (100, 110), (100, 40), (100, 100)))]
    assert cacheopt.provisioning(requests) == {"overprovisioned": 0.5, "underprovisioned": 0.25,
                                               "over_tokens_mean": 20.0, "under_tokens_mean": 60.0}
    unestimated = [cacheopt.TraceRequest("r", 0.0, 10, 100)]
    assert set(cacheopt.provisioning(unestimated).values()) == {None}
