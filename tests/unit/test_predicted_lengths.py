"""What admission tells the engines of a prediction: the padded estimate (CacheOpt) and the range
predicted +- padding as lower bound and median (LayerKV), within [1, max_tokens]."""

from __future__ import annotations

from kvmesh.libs.messages.engine import Targets
from kvmesh.libs.messages.predictor import PredictedLength
from kvmesh.services.admission.predictor_client import with_predicted_lengths


def prediction(predicted: int, padding: float, estimated: int) -> PredictedLength:
    return PredictedLength(predicted=predicted, direction="over", padding=padding, estimated=estimated,
                           confidence=None, predictor="fixed")


def test_the_range_is_the_prediction_plus_minus_its_padding():
    assert with_predicted_lengths(Targets(), prediction(100, 30.5, 131), max_tokens=512) == Targets(
        predicted_output_len=131, predicted_output_median=100, predicted_output_low=69)


def test_the_range_stays_within_one_token_and_max_tokens():
    assert with_predicted_lengths(Targets(), prediction(10, 50.0, 60), max_tokens=512).predicted_output_low == 1
    capped = with_predicted_lengths(Targets(), prediction(900, 0.0, 900), max_tokens=256)
    assert capped.predicted_output_median == capped.predicted_output_low == 256


def test_the_slos_are_kept():
    slos = Targets(ttft_slo_ms=500.0, tbt_slo_ms=50.0)
    told = with_predicted_lengths(slos, prediction(100, 30.5, 131), max_tokens=512)
    assert (told.ttft_slo_ms, told.tbt_slo_ms) == (500.0, 50.0)
