"""CacheOpt's learned output-length predictor (3.2, Fig. 10) on a sentence embedding of the prompt.

Fig. 10 adds two layers to a base model: a linear layer whose hidden representation of the prompt
feeds the length output, and a fully connected binary classifier for the deviation direction whose
input is the base model's representation (here the prompt's sentence embedding) concatenated with
that hidden representation. CacheOpt fine-tunes OPT-13B; kvmesh keeps the encoder frozen (the
service injects it as `embed`, since loading weights is I/O) and trains the two added layers only,
which takes seconds on a CPU.

Training is CacheOpt's two steps: (1) the length regressor alone on the ground-truth lengths;
(2) its predictions on the training data label each example's deviation direction (actual >
predicted: under), and the whole model, classifier included, trains on lengths and labels. A held-out
validation split gives the range (b - a) that Eq. 3 pads with, and the reported errors.

Pure compute: no file or network I/O, no clocks, no threads. `LengthModel.state` / `from_state` give
plain tensors and JSON-able metadata for the service to store.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .padding import DEFAULT_CONFIDENCE, Direction, confidence_padding, error_interval, padded_length
from .predictors import HistoryPredictor, LengthPredictor, LengthQuery, Prediction

Embed = Callable[[list[str]], Tensor]  # texts -> (len(texts), dim) sentence embeddings
FORMAT = "kvmesh.length.embedding/1"
MIN_EXAMPLES = 20  # fewer cannot spare a validation split


class LengthNet(nn.Module):
    """Fig. 10's added layers over a prompt embedding. The regression head predicts log(1 + length):
    output lengths span orders of magnitude, so a squared error on raw tokens would be ruled by the
    longest answers, while in log space an error is relative (20 tokens matter for a 40-token answer,
    not for a 2000-token one), and any output maps back to a length >= 0. Inputs and the target are
    standardised with statistics kept as buffers, so they travel with the weights. No layer behaves
    differently in training, so there is no train/eval mode to keep in step."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(dim, hidden)             # the added linear layer's hidden representation
        self.length = nn.Linear(hidden, 1)               # -> the output length
        self.direction = nn.Linear(dim + hidden, 1)      # the binary classifier: logit of UNDER
        self.register_buffer("x_mean", torch.zeros(dim))
        self.register_buffer("x_scale", torch.ones(dim))
        self.register_buffer("y_mean", torch.zeros(()))
        self.register_buffer("y_scale", torch.ones(()))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(standardised log(1 + length), logit that the length is under-predicted) for each row of x."""
        z = (x - self.x_mean) / self.x_scale
        h = self.hidden(z)
        return self.length(h).squeeze(-1), self.direction(torch.cat([z, h], dim=-1)).squeeze(-1)

    def predict(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(log(1 + length), logit of UNDER) for each row of x."""
        standardised, under_logit = self(x)
        return standardised * self.y_scale + self.y_mean, under_logit


@dataclass(frozen=True, slots=True)
class FitSettings:
    hidden: int = 64              # width of the hidden representation
    steps: int = 300              # optimiser steps in each of the two training steps
    batch_size: int = 128
    learning_rate: float = 3e-3
    # AdamW's weight decays tried; the one whose model does best on the validation split is kept. The
    # head is linear over a 384-dimension embedding, so a few hundred examples are about as many as it
    # has weights per output: without strong decay it memorises them (on 432 real instructions its
    # error was twice the mean length's; with 50, 0.84 of it), while a thousand with a strong signal
    # need little. Step 2's direction labels also need a smooth regressor: one that memorised its
    # examples would leave only noise to label.
    weight_decays: tuple[float, ...] = (0.05, 1.0, 10.0, 50.0)
    validation: float = 0.1       # held-out fraction: the (b - a) range and the reported errors
    coverage: float = 0.9         # (b - a) spans this central fraction of the validation errors
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.hidden, self.steps, self.batch_size) < 1:
            raise ValueError(f"hidden, steps and batch_size must be >= 1, got {self.hidden}, {self.steps}, "
                             f"{self.batch_size}")
        if not (0 < self.validation < 1 and 0 < self.coverage < 1):
            raise ValueError(f"validation and coverage must be in (0, 1), got {self.validation} and {self.coverage}")
        if not (self.learning_rate > 0 and self.weight_decays and min(self.weight_decays) >= 0):
            raise ValueError(f"learning_rate must be > 0 and weight_decays some values >= 0, got {self.learning_rate} "
                             f"and {self.weight_decays}")


@dataclass(frozen=True)
class LengthModel:
    """A trained net and its error band: on the validation split, log(1 + actual) - log(1 + predicted)
    fell between `error_low` and `error_high` for a `coverage` fraction of the examples (the tails cut
    equally). So request i's actual length lies in [a_i, b_i] = (1 + predicted_i) * exp(band) - 1 with
    that frequency, and its (b_i - a_i) grows with its prediction: long answers miss by more tokens."""

    net: LengthNet
    error_low: float
    error_high: float
    coverage: float

    @property
    def dim(self) -> int:
        return self.net.x_mean.shape[0]

    def error_range(self, predicted: int) -> float:
        """(b_i - a_i) in tokens for a request predicted at `predicted` tokens."""
        return (1 + predicted) * (math.exp(self.error_high) - math.exp(self.error_low))

    @torch.no_grad()
    def lengths(self, embeddings: Tensor) -> tuple[Tensor, Tensor]:
        """(predicted lengths as floats >= 0, True where the classifier says UNDER) for each embedding."""
        log_length, under_logit = self.net.predict(embeddings.to(self.net.x_mean.device, torch.float32))
        return torch.expm1(log_length).clamp(min=0), under_logit >= 0

    def state(self) -> tuple[dict[str, Tensor], dict]:
        """Plain tensors (for safetensors) and JSON-able metadata; `from_state` rebuilds the model."""
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.net.state_dict().items()}
        meta = {"format": FORMAT, "dim": self.dim, "hidden": self.net.hidden.out_features,
                "error_low": self.error_low, "error_high": self.error_high, "coverage": self.coverage}
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, Tensor], meta: dict) -> LengthModel:
        if meta.get("format") != FORMAT:
            raise ValueError(f"not an embedding length model: format {meta.get('format')!r}, expected {FORMAT!r}")
        net = LengthNet(int(meta["dim"]), int(meta["hidden"]))
        net.load_state_dict(tensors)  # strict: a missing or misshapen tensor is an error
        return cls(net, float(meta["error_low"]), float(meta["error_high"]), float(meta["coverage"]))


@dataclass(frozen=True, slots=True)
class FitReport:
    """How a fit did on its validation split (lengths in tokens)."""

    examples: int             # training split
    validation_examples: int
    mae: float                # mean |actual - predicted| of the model returned
    baseline_mae: float       # the same for the training split's mean length
    direction_accuracy: float  # how often the classifier named the side of its prediction the actual fell on
    error_low: float          # the model's error band (see LengthModel)
    error_high: float
    kept_previous: bool       # a refit that did worse than the model it started from returns that one
    weight_decay: float | None = None  # the one of FitSettings.weight_decays kept (None: kept_previous)


Progress = Callable[[int, int], None]  # (optimiser steps done, steps in all)


def fit(embeddings: Tensor, lengths: Tensor, settings: FitSettings = FitSettings(),
        start: LengthModel | None = None, progress: Progress | None = None) -> tuple[LengthModel, FitReport]:
    """Train on (n, dim) `embeddings` and their n actual output `lengths` (tokens) in CacheOpt's two
    steps, on a random split of all but `settings.validation` of them, once per weight decay of
    `settings`; the rest measures each model, the best is kept and gives its error band. With `start`
    (a refit) training goes on from that model's weights and standardisation, and when the result
    does worse on the validation split, `start` is returned (with its band measured afresh on the
    same split)."""
    x = embeddings.detach().to(torch.float32)
    y = lengths.detach().to(x.device, torch.float32)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"expected (n, dim) embeddings and n lengths, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] < MIN_EXAMPLES:
        raise ValueError(f"need at least {MIN_EXAMPLES} examples to fit, got {x.shape[0]}")
    if not bool(torch.isfinite(x).all()) or bool((y < 0).any()):
        raise ValueError("embeddings must be finite and lengths >= 0")
    if start is not None and start.dim != x.shape[1]:
        raise ValueError(f"embeddings of dim {x.shape[1]} cannot refit a model of dim {start.dim}")
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(settings.seed)).to(x.device)
    held = max(2, round(settings.validation * x.shape[0]))
    val, train = order[:held], order[held:]
    total = 2 * settings.steps * len(settings.weight_decays)
    fits = []
    for i, weight_decay in enumerate(settings.weight_decays):
        def done(step: int, before: int = 2 * settings.steps * i) -> None:
            if progress is not None:
                progress(before + step, total)
        net = _train(x[train], y[train], settings, weight_decay, start, done)
        model, report = _measure(net, x[val], y[val], y[train], settings.coverage, train.numel())
        fits.append((model, replace(report, weight_decay=weight_decay)))
    model, report = min(fits, key=lambda fitted: fitted[1].mae)
    if start is not None:
        previous, previous_report = _measure(start.net, x[val], y[val], y[train], settings.coverage, train.numel())
        if previous_report.mae < report.mae:
            return previous, replace(previous_report, kept_previous=True)
    return model, report


def _train(x: Tensor, y: Tensor, settings: FitSettings, weight_decay: float, start: LengthModel | None,
           done: Callable[[int], None]) -> LengthNet:
    """CacheOpt's two training steps on (x, y), from `start`'s net or a fresh one."""
    generator = torch.Generator().manual_seed(settings.seed)
    net = copy.deepcopy(start.net) if start is not None else _fresh_net(x, y, settings)
    net.to(x.device)
    target = (torch.log1p(y) - net.y_mean) / net.y_scale
    # Step 1: the regressor alone, on the ground-truth lengths.
    regressor = [*net.hidden.parameters(), *net.length.parameters()]
    _optimise(net, regressor, x, target, None, settings, weight_decay, generator, done)
    # Step 2: label each training example's deviation from its step-1 prediction, then train everything.
    with torch.no_grad():
        under = (torch.log1p(y) > net.predict(x)[0]).float()
    _optimise(net, list(net.parameters()), x, target, under, settings, weight_decay, generator,
              lambda s: done(settings.steps + s))
    return net


def _fresh_net(x: Tensor, y: Tensor, settings: FitSettings) -> LengthNet:
    with torch.random.fork_rng(devices=[]):  # a seeded init that leaves the caller's RNG alone
        torch.manual_seed(settings.seed)
        net = LengthNet(x.shape[1], settings.hidden)
    log_y = torch.log1p(y)
    net.x_mean.copy_(x.mean(0))
    net.x_scale.copy_(x.std(0).clamp(min=1e-6))
    net.y_mean.copy_(log_y.mean())
    net.y_scale.copy_(log_y.std().clamp(min=1e-3))
    return net


def _optimise(net: LengthNet, parameters: list[nn.Parameter], x: Tensor, target: Tensor, under: Tensor | None,
              settings: FitSettings, weight_decay: float, generator: torch.Generator,
              progress: Callable[[int], None]) -> None:
    """`settings.steps` AdamW steps on random mini-batches, the learning rate on a cosine to 0; the loss
    is the squared error of the standardised log length, plus the classifier's cross-entropy when
    `under` labels are given."""
    optimiser = torch.optim.AdamW(parameters, lr=settings.learning_rate, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, settings.steps)
    batch = min(settings.batch_size, x.shape[0])
    for step in range(settings.steps):
        rows = torch.randint(x.shape[0], (batch,), generator=generator).to(x.device)
        predicted, under_logit = net(x[rows])
        loss = F.mse_loss(predicted, target[rows])
        if under is not None:
            loss = loss + F.binary_cross_entropy_with_logits(under_logit, under[rows])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        schedule.step()
        progress(step + 1)


def _measure(net: LengthNet, x: Tensor, y: Tensor, y_train: Tensor, coverage: float,
             examples: int) -> tuple[LengthModel, FitReport]:
    """The model with its error band from (x, y), and its report there."""
    with torch.no_grad():
        log_predicted, under_logit = net.predict(x)
    under = under_logit >= 0
    errors = torch.log1p(y) - log_predicted
    # A diverged net (NaN predictions) gets a NaN band, as torch.quantile gave it, beside its NaN MAE.
    low, high = error_interval(errors.tolist(), coverage) if bool(torch.isfinite(errors).all()) else (math.nan,) * 2
    predicted = torch.expm1(log_predicted).clamp(min=0)
    report = FitReport(examples=examples, validation_examples=y.numel(),
                       mae=float((y - predicted.round()).abs().mean()),
                       baseline_mae=float((y - y_train.mean()).abs().mean()),
                       direction_accuracy=float((under == (y > predicted)).float().mean()),
                       error_low=low, error_high=high, kept_previous=False)
    return LengthModel(net, low, high, coverage), report


class EmbeddingPredictor:
    """The `embedding` length predictor: CacheOpt's model over the prompt's sentence embedding.

    A query with prompt text gets the model's length, the classifier's direction, and Eq. 3's padding
    for (b_i - a_i) = `LengthModel.error_range(predicted)`. A query without text (token ids only), or
    any query before there is a model, gets the `base` predictor's answer (history by default, as RLP
    and S3 take theirs).

    `observe` feeds the base and, for a query with text, remembers (embedding, actual) in a buffer of
    the last `max_examples`. Every `refit_every` remembered examples (None: never) a refit is due: it
    trains on the buffer, going on from the current model. With `refit_in_observe`, `observe` runs it
    at once (seconds of CPU); an owner that must stay responsive passes False and runs the same three
    parts itself: `training_set()` here, `fit(...)` elsewhere (it touches nothing of this object), and
    `install` here.
    """

    def __init__(self, embed: Embed, model: LengthModel | None = None, base: LengthPredictor | None = None,
                 refit_every: int | None = 256, max_examples: int = 4096, settings: FitSettings = FitSettings(),
                 refit_in_observe: bool = True) -> None:
        if refit_every is not None and refit_every < 1:
            raise ValueError(f"refit_every must be >= 1 (or None: never), got {refit_every}")
        if max_examples < MIN_EXAMPLES:
            raise ValueError(f"max_examples must be >= {MIN_EXAMPLES}, got {max_examples}")
        self.embed = embed
        self.model = model
        self.base = base if base is not None else HistoryPredictor()
        self.refit_every = refit_every
        self.settings = settings
        self.refit_in_observe = refit_in_observe
        self._examples: deque[tuple[Tensor, int]] = deque(maxlen=max_examples)
        self._since_refit = 0

    def predict(self, query: LengthQuery, confidence: float = DEFAULT_CONFIDENCE) -> Prediction:
        model = self.model  # one read: an `install` between here and the answer does not mix two models
        if model is None or not query.text:
            return self.base.predict(query, confidence)
        lengths, under = model.lengths(self._embedding(query.text).unsqueeze(0))
        predicted = round(float(lengths[0]))
        direction = Direction.UNDER if bool(under[0]) else Direction.OVER
        padding = confidence_padding(confidence, model.error_range(predicted))
        return Prediction(predicted, direction, padding,
                          padded_length(predicted, padding, direction, query.max_tokens), confidence)

    def observe(self, query: LengthQuery, actual: int) -> None:
        if actual < 0:
            raise ValueError(f"actual output length must be >= 0, got {actual}")
        self.base.observe(query, actual)
        if not query.text:
            return
        self._examples.append((self._embedding(query.text), actual))
        self._since_refit += 1
        if self.refit_in_observe and self.refit_due:
            self.refit()

    @property
    def examples(self) -> int:
        """Prompts remembered for the next refit."""
        return len(self._examples)

    @property
    def refit_due(self) -> bool:
        return (self.refit_every is not None and self._since_refit >= self.refit_every
                and len(self._examples) >= MIN_EXAMPLES)

    def training_set(self) -> tuple[Tensor, Tensor]:
        """The buffer as (embeddings, lengths) tensors of its own; the next refit counts from here."""
        self._since_refit = 0
        return (torch.stack([e for e, _ in self._examples]),
                torch.tensor([n for _, n in self._examples], dtype=torch.float32))

    def install(self, model: LengthModel) -> None:
        self.model = model

    def refit(self) -> FitReport:
        """Train on the buffer, from the current model when there is one, and install the result."""
        model, report = fit(*self.training_set(), self.settings, start=self.model)
        self.install(model)
        return report

    def _embedding(self, text: str) -> Tensor:
        return self.embed([text])[0].detach()
