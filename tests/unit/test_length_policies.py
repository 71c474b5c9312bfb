"""Length prediction and confidence padding (CacheOpt 3.2, issue 7): each equation with numbers worked
by hand from the paper's formula, the baselines' rules, and bounded history."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.policies.length import registry
from kvmesh.policies.length.padding import (DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_CONFIDENCE, Direction,
                                            adaptive_confidence, confidence_padding, error_interval, padded_length)
from kvmesh.policies.length.predictors import (HistoryPredictor, LengthQuery, OraclePredictor, RLPPredictor,
                                               S3Predictor, s3_bucket_upper_bound, s3_doubled_allocation)

# Confidences whose ln(1 - c) is a round number, so Eq. 3 can be done in one's head.
C_LN_MINUS_2 = 1 - math.exp(-2)     # ln(1 - c) = -2   -> t = sqrt(r^2 / 2 * 2)   = r
C_LN_MINUS_HALF = 1 - math.exp(-0.5)  # ln(1 - c) = -1/2 -> t = sqrt(r^2 / 2 * 1/2) = r / 2

unit_interval = st.floats(min_value=0, max_value=1, exclude_min=True, exclude_max=True)
ranges = st.floats(min_value=0, max_value=1e6)
rates = st.floats(min_value=0, max_value=1e6)               # requests per second
alphas = st.floats(min_value=1e-3, max_value=1, exclude_max=True)


def query(tenant: str = "t", max_tokens: int = 1000, **kw) -> LengthQuery:
    return LengthQuery(tenant=tenant, max_tokens=max_tokens, **kw)


def history_of(*lengths: int, **kw) -> HistoryPredictor:
    predictor = HistoryPredictor(**kw)
    for n in lengths:
        predictor.observe(query(), n)
    return predictor


# -- Eq. 3: t_i = sqrt(-(b_i - a_i)^2 / 2 * ln(1 - c_i)) -------------------------------------------

@pytest.mark.parametrize("confidence, error_range, padding", [
    (C_LN_MINUS_2, 40, 40.0),        # sqrt(-(40^2)/2 * -2) = sqrt(1600) = 40
    (C_LN_MINUS_HALF, 60, 30.0),     # sqrt(-(60^2)/2 * -0.5) = sqrt(900) = 30
    (0.9, 100, 107.2983),            # sqrt(-(100^2)/2 * ln 0.1) = sqrt(5000 * 2.302585) = sqrt(11512.93) = 107.298
    (0.5, 10, 5.8871),               # sqrt(-(10^2)/2 * ln 0.5) = sqrt(50 * 0.693147) = sqrt(34.657) = 5.887
    (0.9, 0, 0.0),                   # no spread, no padding
])
def test_eq3_padding_from_confidence_and_error_range(confidence, error_range, padding):
    assert confidence_padding(confidence, error_range) == pytest.approx(padding, abs=1e-4)


def test_eq3_is_per_request_so_padding_does_not_shrink_with_more_observations():
    # Eq. 2 is Eq. 1 with n = 1 (one request's length): no 1/n, so 2 or 20 samples spanning
    # [100, 140] give the same padding, sqrt(-(40^2)/2 * -2) = 40.
    few, many = history_of(100, 140), history_of(*[100, 140] * 10)
    assert few.predict(query(), C_LN_MINUS_2).padding == pytest.approx(40)
    assert many.predict(query(), C_LN_MINUS_2).padding == pytest.approx(40)


@pytest.mark.parametrize("confidence", [0, 1, -0.1, 1.5, math.nan])
def test_eq3_rejects_confidence_outside_open_unit_interval(confidence):
    with pytest.raises(ValueError, match=r"confidence must be in the open interval \(0, 1\)"):
        confidence_padding(confidence, 10)


@pytest.mark.parametrize("error_range", [-1, math.inf, math.nan])
def test_eq3_rejects_empty_or_unbounded_error_range(error_range):
    with pytest.raises(ValueError, match="error range"):
        confidence_padding(0.9, error_range)


@given(c1=unit_interval, c2=unit_interval, error_range=ranges)
def test_eq3_padding_is_monotone_in_confidence(c1, c2, error_range):
    low, high = sorted((c1, c2))
    assert confidence_padding(low, error_range) <= confidence_padding(high, error_range)


@given(confidence=unit_interval, error_range=ranges, scale=st.floats(min_value=0, max_value=100))
def test_eq3_padding_scales_linearly_with_error_range(confidence, error_range, scale):
    scaled = confidence_padding(confidence, scale * error_range)
    assert scaled == pytest.approx(scale * confidence_padding(confidence, error_range), rel=1e-9, abs=1e-9)


# -- direction and clamping -------------------------------------------------------------------------

def test_under_prediction_adds_padding_and_over_prediction_subtracts_it():
    assert padded_length(100, 40, Direction.UNDER, 1000) == 140
    assert padded_length(100, 40, Direction.OVER, 1000) == 60


def test_estimated_length_rounds_toward_more_kv():
    assert padded_length(100, 10.2, Direction.UNDER, 1000) == 111   # ceil(110.2)
    assert padded_length(100, 10.2, Direction.OVER, 1000) == 90     # ceil(89.8)


def test_estimated_length_is_clamped_to_one_and_max_tokens():
    assert padded_length(30, 40, Direction.OVER, 1000) == 1          # 30 - 40 < 1
    assert padded_length(990, 40, Direction.UNDER, 1000) == 1000     # 990 + 40 > max_tokens


def test_padded_length_rejects_bad_input():
    with pytest.raises(ValueError, match="max_tokens"):
        padded_length(10, 1, Direction.UNDER, 0)
    with pytest.raises(ValueError, match="padding"):
        padded_length(10, -1, Direction.UNDER, 100)


@given(predicted=st.integers(0, 10_000), padding=ranges, max_tokens=st.integers(1, 10_000))
def test_estimated_length_stays_in_bounds_and_under_is_never_below_over(predicted, padding, max_tokens):
    under = padded_length(predicted, padding, Direction.UNDER, max_tokens)
    over = padded_length(predicted, padding, Direction.OVER, max_tokens)
    assert 1 <= over <= under <= max_tokens


# -- Eq. 3's (a_i, b_i): the predictor's measured errors ------------------------------------------

@pytest.mark.parametrize("errors, coverage, interval", [
    # 5 sorted errors: quantile q sits at position q * 4. Central 50%: positions 1 and 3.
    ((100, -30, 20, 0, -10), 0.5, (-10.0, 20.0)),
    # central 90%: positions 0.2 and 3.8, -30 + 0.2 * 20 = -26 and 20 + 0.8 * 80 = 84
    ((100, -30, 20, 0, -10), 0.9, (-26.0, 84.0)),
    # 11 errors -50..50 by 10: central 80% at positions 1 and 9
    (tuple(range(-50, 51, 10)), 0.8, (-40.0, 40.0)),
    # one-sided errors (a predictor that always over-predicts) keep their sign
    ((-40, -10, -20, -30), 0.5, (-32.5, -17.5)),
    ((7,), 0.9, (7.0, 7.0)),   # one error: a range of 0, no padding
])
def test_eq3_interval_is_the_central_coverage_of_the_signed_errors(errors, coverage, interval):
    assert error_interval(errors, coverage) == pytest.approx(interval)


def test_eq3_padding_from_measured_errors():
    # central 90% of 0..100 by 1 is [5, 95]: (b - a) = 90, and at c = 1 - e^-2 Eq. 3 pads by it.
    a, b = error_interval(range(101), 0.9)
    assert (a, b) == pytest.approx((5.0, 95.0))
    assert confidence_padding(C_LN_MINUS_2, b - a) == pytest.approx(90.0)


@pytest.mark.parametrize("errors, coverage, message", [
    ((), 0.9, "at least one"), ((1, math.nan), 0.9, "finite"), ((1, math.inf), 0.9, "finite"),
    ((1, 2), 0.0, "coverage"), ((1, 2), 1.0, "coverage"),
])
def test_eq3_interval_rejects_bad_input(errors, coverage, message):
    with pytest.raises(ValueError, match=message):
        error_interval(errors, coverage)


@given(errors=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), coverage=unit_interval)
def test_eq3_interval_is_ordered_and_within_the_errors(errors, coverage):
    a, b = error_interval(errors, coverage)
    assert min(errors) <= a <= b <= max(errors)


# -- Eq. 4: c_i = alpha / (1 + beta * lambda), lambda in requests per millisecond ------------------

def test_eq4_defaults_are_the_papers():
    assert (DEFAULT_CONFIDENCE, DEFAULT_ALPHA, DEFAULT_BETA) == (0.9, 0.9, 100.0)


@pytest.mark.parametrize("rate, alpha, beta, confidence", [   # rate in req/s, lambda = rate / 1000
    (0.0, 0.9, 100, 0.9),            # 0.9 / (1 + 100 * 0)     = 0.9, the maximum
    (1.0, 0.9, 100, 0.9 / 1.1),      # 0.9 / (1 + 100 * 0.001) = 0.818
    (10.0, 0.9, 100, 0.45),          # 0.9 / (1 + 100 * 0.01)  = 0.9 / 2  = 0.45
    (28.0, 0.9, 100, 0.9 / 3.8),     # the paper's ShareGPT rate: 0.237
    (80.0, 0.9, 100, 0.1),           # 0.9 / (1 + 100 * 0.08)  = 0.9 / 9  = 0.1
    (1500.0, 0.5, 2, 0.125),         # 0.5 / (1 + 2 * 1.5)     = 0.5 / 4  = 0.125
])
def test_eq4_confidence_from_arrival_rate(rate, alpha, beta, confidence):
    assert adaptive_confidence(rate, alpha, beta) == pytest.approx(confidence)


def test_eq4_then_eq3_at_zero_rate_pads_by_the_error_range():
    # alpha = 1 - e^-2 at lambda = 0 gives c = alpha, and Eq. 3 then gives t = (b - a) = 40.
    assert confidence_padding(adaptive_confidence(0.0, alpha=C_LN_MINUS_2), 40) == pytest.approx(40)


@pytest.mark.parametrize("kwargs, message", [
    (dict(arrival_rate=-1.0), "arrival rate"),
    (dict(arrival_rate=math.nan), "arrival rate"),
    (dict(arrival_rate=1.0, alpha=0.0), "alpha"),
    (dict(arrival_rate=1.0, alpha=1.0), "alpha"),      # c = 1 at lambda = 0: Eq. 3 would pad without end
    (dict(arrival_rate=1.0, alpha=8.0), "alpha"),      # section 5's printed alpha = 8 breaks 0 < alpha <= 1
    (dict(arrival_rate=1.0, beta=0.0), "beta"),
    (dict(arrival_rate=1.0, beta=-1.0), "beta"),
])
def test_eq4_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        adaptive_confidence(**kwargs)


@given(r1=rates, r2=rates, alpha=alphas, beta=st.floats(1e-6, 1e6))
def test_eq4_confidence_stays_in_zero_alpha_and_falls_as_rate_rises(r1, r2, alpha, beta):
    low, high = sorted((r1, r2))
    assert 0 < adaptive_confidence(high, alpha, beta) <= adaptive_confidence(low, alpha, beta) <= alpha


@given(rate=rates, alpha=alphas, beta=st.floats(1e-6, 1e6), error_range=ranges)
def test_eq4_always_yields_a_confidence_eq3_can_pad_with(rate, alpha, beta, error_range):
    assert 0 <= confidence_padding(adaptive_confidence(rate, alpha, beta), error_range) < math.inf


# -- RLP and S3 ------------------------------------------------------------------------------------

def test_rlp_adds_a_fixed_100_tokens_to_the_base_prediction():
    prediction = RLPPredictor(OraclePredictor()).predict(query(true_length=120))
    assert (prediction.predicted, prediction.padding, prediction.estimated) == (120, 100.0, 220)
    assert prediction.direction is Direction.UNDER and prediction.confidence is None


def test_rlp_is_capped_by_max_tokens_and_learns_through_its_base():
    assert RLPPredictor(OraclePredictor()).predict(query(max_tokens=200, true_length=120)).estimated == 200
    rlp = RLPPredictor()                    # history base
    for n in (40, 50, 60):
        rlp.observe(query(), n)
    assert rlp.predict(query()).estimated == 150   # mean 50 + 100


@pytest.mark.parametrize("predicted, upper", [(0, 50), (49, 50), (50, 100), (120, 150), (199, 200)])
def test_s3_allocates_the_upper_bound_of_the_50_token_bucket(predicted, upper):
    assert s3_bucket_upper_bound(predicted) == upper


def test_s3_prediction_pads_to_the_bucket_bound_within_max_tokens():
    s3 = S3Predictor(OraclePredictor())
    prediction = s3.predict(query(true_length=120))
    assert (prediction.predicted, prediction.padding, prediction.estimated) == (120, 30.0, 150)
    assert s3.predict(query(max_tokens=130, true_length=120)).estimated == 130


def test_s3_doubles_the_failed_allocation_until_max_tokens():
    allocations = [150]
    for _ in range(4):
        allocations.append(s3_doubled_allocation(allocations[-1], max_tokens=1000))
    assert allocations == [150, 300, 600, 1000, 1000]


def test_s3_and_rlp_reject_bad_input():
    with pytest.raises(ValueError, match="failed allocation"):
        s3_doubled_allocation(0, 100)
    with pytest.raises(ValueError, match="predicted length"):
        s3_bucket_upper_bound(-1)
    with pytest.raises(ValueError, match="bucket"):
        S3Predictor(bucket=0)
    with pytest.raises(ValueError, match="padding"):
        RLPPredictor(padding=-1)


# -- history ---------------------------------------------------------------------------------------

def test_history_without_observations_allocates_max_tokens_unpadded():
    prediction = HistoryPredictor().predict(query(max_tokens=512))
    assert (prediction.predicted, prediction.padding, prediction.estimated) == (512, 0.0, 512)


def test_history_pads_its_mean_by_eq3_over_its_error_range_upward():
    # lengths 100, 120, 140: mean 120, one below and two at or above it -> UNDER;
    # (b - a) = 40, c = 1 - e^-2 -> t = 40, estimated 120 + 40 = 160.
    prediction = history_of(100, 120, 140).predict(query(), C_LN_MINUS_2)
    assert (prediction.predicted, prediction.direction, prediction.padding, prediction.estimated) == \
        (120, Direction.UNDER, pytest.approx(40), 160)
    assert prediction.confidence == C_LN_MINUS_2


def test_history_subtracts_padding_when_its_mean_mostly_over_predicts():
    # lengths 100, 100, 160: mean 120, two below it -> OVER;
    # (b - a) = 60, c = 1 - e^-0.5 -> t = 30, estimated 120 - 30 = 90.
    prediction = history_of(100, 100, 160).predict(query(), C_LN_MINUS_HALF)
    assert (prediction.direction, prediction.padding, prediction.estimated) == (Direction.OVER, pytest.approx(30), 90)


def test_history_keeps_only_its_window_per_key():
    history = history_of(10, 20, 30, 1000, window=3)       # 10 falls out
    assert history.error_range("t") == 1000 - 20
    assert history.predict(query()).predicted == 350       # (20 + 30 + 1000) / 3


def test_history_evicts_the_least_recently_used_key():
    history = HistoryPredictor(max_keys=2)
    history.observe(query("a"), 10)
    history.observe(query("b"), 20)
    history.predict(query("a"))                            # a is now the most recent
    history.observe(query("c"), 30)
    assert history.keys() == ["a", "c"]
    assert history.error_range("b") is None


def test_history_keys_by_template_before_tenant():
    history = HistoryPredictor()
    history.observe(query("t", template="summarise"), 300)
    history.observe(query("t"), 40)
    assert history.predict(query("other", template="summarise")).predicted == 300
    assert history.predict(query("t")).predicted == 40


def test_history_rejects_bad_input():
    with pytest.raises(ValueError, match="window"):
        HistoryPredictor(window=0)
    with pytest.raises(ValueError, match="actual output length"):
        HistoryPredictor().observe(query(), -1)
    with pytest.raises(ValueError, match="max_tokens"):
        query(max_tokens=0)


# -- oracle and registry ---------------------------------------------------------------------------

def test_oracle_returns_the_true_length_unpadded():
    prediction = OraclePredictor().predict(query(true_length=37))
    assert (prediction.predicted, prediction.padding, prediction.estimated) == (37, 0.0, 37)
    with pytest.raises(ValueError, match="true_length"):
        OraclePredictor().predict(query())


def test_registry_builds_each_predictor_by_name():
    assert registry.names() == ["history", "rlp", "s3", "oracle", "embedding"]
    assert registry.DEFAULT in registry.names()
    for name in registry.names():
        # The embedding predictor needs an encoder; these queries carry no text, so it never runs.
        options = {"embed": None} if name == "embedding" else {}
        predictor = registry.resolve(name)(**options)
        predictor.observe(query(), 80)
        assert 1 <= predictor.predict(query(true_length=80)).estimated <= 1000
    assert registry.resolve("history")() is not registry.resolve("history")()


def test_registry_names_the_known_ones_for_an_unknown_name():
    with pytest.raises(KeyError, match="known: history, rlp, s3, oracle, embedding"):
        registry.resolve("nope")
