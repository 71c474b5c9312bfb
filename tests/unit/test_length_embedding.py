"""The `embedding` length predictor (CacheOpt 3.2, Fig. 10) on synthetic embeddings: the two-step
training learns the length and a direction signal, (b - a) comes from the validation errors, a
prediction pads by Eq. 3 in the classifier's direction, and observe keeps a bounded buffer and refits."""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.policies.length.embedding import (MIN_EXAMPLES, EmbeddingPredictor, FitSettings, LengthModel,
                                              LengthNet, fit)
from kvmesh.policies.length.padding import Direction, confidence_padding, padded_length
from kvmesh.policies.length.predictors import HistoryPredictor, LengthQuery

DIM = 32
C_LN_MINUS_2 = 1 - math.exp(-2)  # ln(1 - c) = -2: Eq. 3 gives t = (b - a)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def synthetic(n: int, seed: int, noise: float = 15.0, skewed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """n random embeddings and lengths 300 + 100 * (x . w) plus noise, from a fixed w (and u).
    `skewed`: the noise is 30 * (E - 1), E ~ Exp(1), mirrored where x . u < 0: right-skewed noise
    leaves most lengths below the mean, so the direction of a good prediction depends on sign(x . u)."""
    weights = torch.Generator().manual_seed(1234)
    w = torch.randn(DIM, generator=weights) / math.sqrt(DIM)
    u = torch.nn.functional.normalize(torch.randn(DIM, generator=weights), dim=0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    if skewed:
        e = torch.empty(n).exponential_(generator=g) - 1
        deviation = 30 * torch.sign(x @ u) * e
    else:
        deviation = noise * torch.randn(n, generator=g)
    return x, (300 + 100 * (x @ w) + deviation).clamp(min=1).round()


def query(text: str | None = None, max_tokens: int = 1000) -> LengthQuery:
    return LengthQuery(tenant="t", max_tokens=max_tokens, text=text)


def test_two_step_training_learns_the_length_far_better_than_the_mean():
    x, y = synthetic(1000, seed=0)
    model, report = fit(x, y, FitSettings())
    assert (report.examples, report.validation_examples) == (900, 100)
    assert report.mae < 0.4 * report.baseline_mae  # measured: 16.7 vs 53.8 tokens (the noise alone: 12)
    fresh_x, fresh_y = synthetic(500, seed=1)
    predicted, _ = model.lengths(fresh_x)
    assert (fresh_y - predicted).abs().mean() < 0.4 * (fresh_y - y.mean()).abs().mean()  # 15.6 vs 60.6


def test_with_about_as_many_examples_as_weights_the_fit_keeps_a_strong_decay_and_beats_the_mean():
    """384 dimensions, 400 examples and a weak signal (a real prompt's embedding against its answer
    length): a lightly decayed head memorises them and does worse than the mean length on new ones."""
    weights = torch.Generator().manual_seed(7)
    w = torch.randn(384, generator=weights) / math.sqrt(384)

    def weak(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 384, generator=g)
        return x, (200 + 100 * (x @ w) + 50 * torch.randn(n, generator=g)).clamp(min=1).round()

    x, y = weak(400, seed=0)
    fresh_x, fresh_y = weak(1000, seed=1)
    mean_error = float((fresh_y - y.mean()).abs().mean())
    light, _ = fit(x, y, FitSettings(weight_decays=(0.05,)))
    model, report = fit(x, y, FitSettings())
    assert report.weight_decay == max(FitSettings().weight_decays)
    assert float((fresh_y - light.lengths(fresh_x)[0]).abs().mean()) > 2 * mean_error   # measured: 486 vs 79
    assert float((fresh_y - model.lengths(fresh_x)[0]).abs().mean()) < mean_error       # 73


def test_the_classifier_learns_which_way_the_length_deviates():
    x, y = synthetic(2000, seed=0, skewed=True)
    model, report = fit(x, y, FitSettings())
    fresh_x, fresh_y = synthetic(1000, seed=1, skewed=True)
    predicted, under = model.lengths(fresh_x)
    accuracy = float((under == (fresh_y > predicted)).float().mean())
    # P(E > 1) = 1/e: about 63% of each half lies on one side of its mean; chance is 50%.
    assert accuracy > 0.57 and report.direction_accuracy > 0.57  # measured: 0.594 and 0.62


def test_the_error_range_comes_from_the_validation_errors():
    x, y = synthetic(1000, seed=0)
    model, report = fit(x, y, FitSettings(coverage=0.9))
    assert (model.error_low, model.error_high, model.coverage) == (report.error_low, report.error_high, 0.9)
    assert model.error_low < 0 < model.error_high
    # The band covers about 90% of the log errors of lengths it has not seen...
    fresh_x, fresh_y = synthetic(2000, seed=1)
    predicted, _ = model.lengths(fresh_x)
    errors = torch.log1p(fresh_y) - torch.log1p(predicted)
    inside = float(((errors >= model.error_low) & (errors <= model.error_high)).float().mean())
    assert 0.84 < inside < 0.96  # measured: 0.897
    # ...(b - a) is the band around the request's own prediction, in tokens...
    assert model.error_range(100) == pytest.approx(101 * (math.exp(model.error_high) - math.exp(model.error_low)))
    # ...and it widens with the noise: four times the noise, a band about three or more times wider.
    noisy, _ = fit(*synthetic(1000, seed=0, noise=60.0), FitSettings())
    assert noisy.error_range(300) > 2.5 * model.error_range(300)  # measured: 3.27 times


def constant_model(predicted: int, low: float, high: float) -> LengthModel:
    """A 2-d model that predicts `predicted` tokens for any input, UNDER when x[0] > 0, else OVER."""
    net = LengthNet(2, 1)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.zero_()
        net.y_mean.fill_(math.log1p(predicted))
        net.direction.weight[0, 0] = 1.0
    return LengthModel(net, math.log(low), math.log(high), 0.9)


EMBEDDINGS = {"long answer please": [1.0, 0.0], "short answer please": [-1.0, 0.0]}


def embed(texts: list[str]) -> torch.Tensor:
    return torch.tensor([EMBEDDINGS[t] for t in texts])


def test_predict_pads_by_eq3_in_the_classifier_direction():
    predictor = EmbeddingPredictor(embed, constant_model(100, 0.8, 1.3))
    # (b - a) = (1 + 100) * (1.3 - 0.8) = 50.5 tokens; ln(1 - c) = -2 makes t = (b - a) = 50.5.
    under = predictor.predict(query("long answer please"), C_LN_MINUS_2)
    assert under.padding == pytest.approx(confidence_padding(C_LN_MINUS_2, 50.5)) == pytest.approx(50.5)
    assert (under.predicted, under.direction, under.estimated, under.confidence) == (
        100, Direction.UNDER, 151, C_LN_MINUS_2)  # ceil(100 + 50.5)
    over = predictor.predict(query("short answer please"), C_LN_MINUS_2)
    assert (over.predicted, over.direction, over.estimated) == (100, Direction.OVER, 50)  # ceil(100 - 50.5)
    c = 0.9  # sqrt(-(50.5^2) / 2 * ln 0.1) = 54.18
    at_90 = predictor.predict(query("long answer please", max_tokens=120), c)
    assert at_90.padding == pytest.approx(confidence_padding(c, 50.5)) == pytest.approx(54.18, abs=0.01)
    assert at_90.estimated == padded_length(100, at_90.padding, Direction.UNDER, 120) == 120  # capped


def test_without_text_or_model_the_base_predictor_answers():
    base = HistoryPredictor()
    base.observe(query(), 40)
    with_model = EmbeddingPredictor(embed, constant_model(100, 0.8, 1.3), base=base)
    assert with_model.predict(query()) == base.predict(query())  # token ids only: no text to embed
    without = EmbeddingPredictor(embed, base=base)
    assert without.predict(query("long answer please")) == base.predict(query())


def indexed(x: torch.Tensor):
    """An `embed` for texts "0", "1", ...: row i of x."""
    return lambda texts: x[[int(t) for t in texts]]


def test_observe_keeps_a_bounded_buffer_and_refits_every_n_prompts():
    x, y = synthetic(400, seed=0)
    predictor = EmbeddingPredictor(indexed(x), refit_every=100, max_examples=150, settings=FitSettings(steps=50))
    for i in range(99):
        predictor.observe(query(str(i)), int(y[i]))
        predictor.observe(query(), 7)  # no text: the base learns it, the buffer does not
    assert predictor.model is None and predictor.examples == 99
    predictor.observe(query("99"), int(y[99]))
    first = predictor.model
    assert first is not None and not predictor.refit_due  # the 100th prompt refitted at once
    assert predictor.predict(query("0")).predicted != predictor.predict(query()).predicted
    for i in range(100, 400):
        predictor.observe(query(str(i)), int(y[i]))
        assert predictor.examples <= 150
    assert predictor.examples == 150 and predictor.model is not first
    embeddings, lengths = predictor.training_set()
    assert torch.equal(embeddings, x[250:]) and torch.equal(lengths, y[250:])  # the last 150


def test_an_owner_can_run_the_refit_itself():
    x, y = synthetic(200, seed=0)
    predictor = EmbeddingPredictor(indexed(x), refit_every=50, refit_in_observe=False, settings=FitSettings(steps=50))
    for i in range(120):
        predictor.observe(query(str(i)), int(y[i]))
    assert predictor.model is None and predictor.refit_due
    embeddings, lengths = predictor.training_set()
    assert not predictor.refit_due and embeddings.shape == (120, DIM)
    model, _ = fit(embeddings, lengths, predictor.settings)
    predictor.install(model)
    assert predictor.model is model


def test_a_refit_that_does_worse_keeps_the_model_it_started_from():
    x, y = synthetic(600, seed=0)
    good, _ = fit(x, y, FitSettings())
    ruined, report = fit(x, y, FitSettings(steps=3, learning_rate=50.0), start=good)
    assert report.kept_previous and ruined.net is good.net
    weak, _ = fit(x, y, FitSettings(steps=3, learning_rate=1e-4))
    refitted, report = fit(x, y, FitSettings(), start=weak)
    assert not report.kept_previous and refitted.net is not weak.net


def test_state_round_trips_as_plain_tensors_and_json():
    x, y = synthetic(300, seed=0)
    model, _ = fit(x, y, FitSettings(steps=50))
    tensors, meta = model.state()
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert meta == {"format": "kvmesh.length.embedding/1", "dim": DIM, "hidden": 64, "error_low": model.error_low,
                    "error_high": model.error_high, "coverage": 0.9}
    loaded = LengthModel.from_state(tensors, meta)
    assert torch.equal(loaded.lengths(x)[0], model.lengths(x)[0])
    assert torch.equal(loaded.lengths(x)[1], model.lengths(x)[1])
    with pytest.raises(ValueError, match="format"):
        LengthModel.from_state(tensors, {**meta, "format": "other"})


def test_fit_rejects_what_it_cannot_train_on():
    x, y = synthetic(100, seed=0)
    with pytest.raises(ValueError, match=f"at least {MIN_EXAMPLES}"):
        fit(x[:MIN_EXAMPLES - 1], y[:MIN_EXAMPLES - 1])
    with pytest.raises(ValueError, match="lengths >= 0"):
        fit(x, -y)
    with pytest.raises(ValueError, match="n lengths"):
        fit(x, y[:-1])
    with pytest.raises(ValueError, match="dim"):
        fit(x[:, :8], y, start=fit(x, y, FitSettings(steps=5))[0])
    with pytest.raises(ValueError, match="validation"):
        FitSettings(validation=1.0)
    with pytest.raises(ValueError, match="refit_every"):
        EmbeddingPredictor(embed, refit_every=0)
    with pytest.raises(ValueError, match="actual output length"):
        EmbeddingPredictor(embed).observe(query("long answer please"), -1)
