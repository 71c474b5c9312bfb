"""The predictor: `POST /v1/predict` estimates a request's output length with CacheOpt's confidence
padding (Eq. 3, c from Eq. 4 and the measured arrival rate), `POST /v1/observe` learns from the
actual length when a request ends, `GET`/`PUT /v1/config` (docs/cacheopt.md, "The predictor service").

The predictors and the arrival-rate estimate are the pure ones of `policies/length`; this service adds
the clock and the metrics. It keeps one `history` predictor for its whole life, and a predictor built
on a base one (rlp, s3, embedding) gets it as its base, so switching predictor keeps what was learned.
With `model_path` (a `kvmesh predictor train` directory) it also offers `embedding`, CacheOpt's learned
predictor, kept for the service's life too and refitted as prompts are observed (learning.py).

Every predictor call runs on one thread of the service's own: the embedding predictor's encoder takes
milliseconds that must not stall the event loop, and the predictors' state is then only touched there.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from aiohttp import web
from msgspec import Meta
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.libs.controlplane import BadRequest, Service, ServiceConfig
from kvmesh.libs.messages.predictor import (ConfigChange, ObserveRequest, OpenUnit, PredictRequest, PredictedLength,
                                            PredictorSettings)
from kvmesh.policies.length import LengthPredictor, LengthQuery, adaptive_confidence, registry
from kvmesh.policies.length.arrival_rate import ArrivalRate, arrive, rate_at
from kvmesh.policies.length.padding import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_CONFIDENCE
from kvmesh.policies.length.predictors import HistoryPredictor

log = logging.getLogger(__name__)

ERROR_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)  # tokens
NO_MODEL = "the embedding predictor needs a trained model: set model_path to a directory `kvmesh predictor train` wrote"


class Config(ServiceConfig, kw_only=True):
    port: int = 8101
    predictor: str = registry.DEFAULT
    alpha: OpenUnit = DEFAULT_ALPHA          # Eq. 4: the confidence as the arrival rate goes to 0
    beta: Annotated[float, Meta(gt=0)] = DEFAULT_BETA  # Eq. 4: how fast it falls as the rate rises
    confidence: OpenUnit = DEFAULT_CONFIDENCE  # the fixed c when not `adaptive`
    adaptive: bool = True                    # c from Eq. 4 and the measured rate, else `confidence`
    rate_window_s: Annotated[float, Meta(gt=0)] = 10.0  # the arrival rate's time constant (rate.py)
    model_path: str | None = None            # a `kvmesh predictor train` directory: offers `embedding`
    refit_every: Annotated[int, Meta(ge=1)] = 256  # embedding: refit after this many observed prompts
    torch_threads: Annotated[int, Meta(ge=0)] = 0  # embedding: encoder and refit threads (0: torch's default)

    def __post_init__(self) -> None:
        if self.predictor not in registry.names():
            raise ValueError(f"predictor {self.predictor!r} is not one of {', '.join(registry.names())}")
        if self.predictor == "embedding" and self.model_path is None:
            raise ValueError(NO_MODEL)
        if self.model_path is not None and not Path(self.model_path).is_dir():
            raise ValueError(f"model_path {self.model_path!r} is not a directory")
        for name in ("beta", "rate_window_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")


@dataclass
class InForce:
    """The settings `PUT /v1/config` changes, and the predictor they name."""

    name: str
    predictor: LengthPredictor
    alpha: float
    beta: float
    confidence: float
    adaptive: bool

    def confidence_at(self, arrival_rate: float) -> float:
        """c_i for a request arriving at this rate: CacheOpt Eq. 4 when adaptive, else the fixed c."""
        return adaptive_confidence(arrival_rate, self.alpha, self.beta) if self.adaptive else self.confidence


class PredictionMetrics:
    """How well the predictions served: absolute error and under/over-provisioning, per predictor."""

    def __init__(self, metrics: CollectorRegistry):
        self.predictions = Counter("kvmesh_predictor_predictions", "Predictions answered, by predictor",
                                   ["predictor"], registry=metrics)
        self.observations = Counter("kvmesh_predictor_observations", "Actual lengths observed, by the "
                                    "predictor in force", ["predictor"], registry=metrics)
        self.error = Histogram("kvmesh_predictor_abs_error_tokens", "Prediction absolute error "
                               "|predicted - actual| in tokens, of observations that carry `predicted`",
                               ["predictor"], buckets=ERROR_BUCKETS, registry=metrics)
        self.under = Counter("kvmesh_predictor_underprovisioned", "Observed requests whose estimated "
                             "length was below the actual one (estimated < actual)", ["predictor"], registry=metrics)
        self.over = Counter("kvmesh_predictor_overprovisioned", "Observed requests whose estimated "
                            "length was above the actual one (estimated > actual)", ["predictor"], registry=metrics)
        self.refits = Counter("kvmesh_predictor_refits", "Refits of the embedding predictor by outcome: "
                              "installed, kept (the refit did worse on its validation split), failed",
                              ["outcome"], registry=metrics)

    def show(self, predictor: str) -> None:
        """Expose the predictor's series at zero before its first prediction."""
        for family in (self.predictions, self.observations, self.error, self.under, self.over):
            family.labels(predictor)

    def observed(self, predictor: str, body: ObserveRequest) -> None:
        self.observations.labels(predictor).inc()
        if body.predicted is not None:
            self.error.labels(predictor).observe(abs(body.predicted - body.actual))
        if body.estimated is not None and body.estimated < body.actual:
            self.under.labels(predictor).inc()
        if body.estimated is not None and body.estimated > body.actual:
            self.over.labels(predictor).inc()


def build_predictor(name: str, history: HistoryPredictor, embedding: LengthPredictor | None) -> LengthPredictor:
    """Predictor `name` (KeyError when unknown), built on the service's `history` when it takes a base;
    `embedding` is the service's own (BadRequest without a model)."""
    if name == "history":
        return history
    if name == "embedding":
        if embedding is None:
            raise BadRequest(NO_MODEL)
        return embedding
    factory = registry.resolve(name)
    if "base" in inspect.signature(factory).parameters:
        return factory(base=history)
    return factory()


class PredictorRoutes:
    """The predictor's routes, one method each, and what they share: the predictor in force (and the
    `history` and `embedding` ones kept for the service's life), the arrival rate, the metrics, and
    the two threads every predictor call and every refit run on."""

    def __init__(self, config: Config, metrics: CollectorRegistry):
        self.config = config
        self.history = HistoryPredictor()
        self.embedding = None
        if config.model_path is not None:
            from . import learning
            self.embedding = learning.load(config.model_path, self.history, config.refit_every, config.torch_threads)
        self.current = InForce(config.predictor, build_predictor(config.predictor, self.history, self.embedding),
                               config.alpha, config.beta, config.confidence, config.adaptive)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="predictor")
        self.trainer = ThreadPoolExecutor(1, thread_name_prefix="predictor-refit")
        self.refitting: asyncio.Task | None = None
        self.arrivals = ArrivalRate(at=time.monotonic())
        self.metrics = PredictionMetrics(metrics)
        self.metrics.show(self.current.name)
        Gauge("kvmesh_predictor_arrival_rate", f"Arrival rate of /v1/predict calls, requests/s, exponentially "
              f"weighted with a {config.rate_window_s:g} s time constant", registry=metrics
              ).set_function(lambda: rate_at(self.arrivals, time.monotonic(), config.rate_window_s))
        if self.embedding is not None:
            Gauge("kvmesh_predictor_embedding_examples", "Observed prompts the embedding predictor keeps for its "
                  "refits, the latest ones", registry=metrics).set_function(lambda: self.embedding.examples)

    async def on_worker(self, call, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, call, *args)

    async def executors(self, app: web.Application) -> AsyncIterator[None]:
        yield
        if self.refitting is not None:
            self.refitting.cancel()
        self.worker.shutdown(cancel_futures=True)
        self.trainer.shutdown(wait=False, cancel_futures=True)  # a refit under way ends with the process

    async def refit(self) -> None:
        from . import learning
        started = time.perf_counter()
        try:
            report = await learning.refit(self.embedding, self.on_worker, self.trainer)
        except Exception:
            log.exception("embedding refit failed; the model in force stays")
            self.metrics.refits.labels("failed").inc()
        else:
            outcome = "kept" if report.kept_previous else "installed"
            self.metrics.refits.labels(outcome).inc()
            log.info("embedding refit on %d examples in %.1f s: %s, validation MAE %.1f tokens (mean length "
                     "%.1f), direction accuracy %.2f", report.examples + report.validation_examples,
                     time.perf_counter() - started, outcome, report.mae, report.baseline_mae,
                     report.direction_accuracy)
        finally:
            self.refitting = None

    async def predict(self, request: web.Request, body: PredictRequest) -> PredictedLength:
        """Predict a request's output length, padded for the confidence in force."""
        config, current = self.config, self.current
        now = time.monotonic()
        self.arrivals = arrive(self.arrivals, now, config.rate_window_s)
        confidence = current.confidence_at(rate_at(self.arrivals, now, config.rate_window_s))
        try:
            prediction = await self.on_worker(current.predictor.predict, _query(body), confidence)
        except ValueError as exc:  # e.g. the oracle without a true_length
            raise BadRequest(f"predictor {current.name!r}: {exc}") from None
        self.metrics.predictions.labels(current.name).inc()
        return PredictedLength(predicted=prediction.predicted, direction=str(prediction.direction),
                               padding=prediction.padding, estimated=prediction.estimated,
                               confidence=prediction.confidence, predictor=current.name)

    async def observe(self, request: web.Request, body: ObserveRequest) -> None:
        """Learn a finished request's actual output length."""
        # Learning reads only the keys and the prompt text; max_tokens is any valid cap.
        query = LengthQuery(tenant=body.tenant, max_tokens=max(body.actual, 1), template=body.template,
                            text=body.prompt)
        name, predictor = self.current.name, self.current.predictor
        await self.on_worker(predictor.observe, query, body.actual)
        self.metrics.observed(name, body)
        if predictor is self.embedding and self.embedding.refit_due and self.refitting is None:
            self.refitting = asyncio.create_task(self.refit())

    async def get_config(self, request: web.Request) -> PredictorSettings:
        """The settings in force, the predictors to choose from and the measured arrival rate."""
        return self.settings()

    async def set_config(self, request: web.Request, body: ConfigChange) -> PredictorSettings:
        """Change the predictor or the confidence settings; the next prediction uses them."""
        current = self.current
        if body.predictor is not None and body.predictor != current.name:
            try:
                predictor = build_predictor(body.predictor, self.history, self.embedding)
            except KeyError:
                raise BadRequest(f"no length predictor named {body.predictor!r}; "
                                 f"known: {', '.join(self.available())}") from None
            log.info("length predictor: %s -> %s", current.name, body.predictor)
            current.name, current.predictor = body.predictor, predictor
            self.metrics.show(current.name)
        for name in ("alpha", "beta", "confidence", "adaptive"):
            if getattr(body, name) is not None:
                setattr(current, name, getattr(body, name))
        return self.settings()

    def settings(self) -> PredictorSettings:
        current, config = self.current, self.config
        return PredictorSettings(predictor=current.name, alpha=current.alpha, beta=current.beta,
                                 confidence=current.confidence, adaptive=current.adaptive,
                                 rate_window_s=config.rate_window_s,
                                 arrival_rate=rate_at(self.arrivals, time.monotonic(), config.rate_window_s),
                                 available=self.available())

    def available(self) -> list[str]:
        return [name for name in registry.names() if name != "embedding" or self.embedding is not None]


def build_service(config: Config) -> Service:
    service = Service("predictor", config)
    predictor = PredictorRoutes(config, service.metrics)
    service.lifespan(predictor.executors)

    service.route("POST", "/v1/predict", body=PredictRequest, response=PredictedLength)(predictor.predict)
    service.route("POST", "/v1/observe", body=ObserveRequest)(predictor.observe)
    service.route("GET", "/v1/config", response=PredictorSettings)(predictor.get_config)
    service.route("PUT", "/v1/config", body=ConfigChange, response=PredictorSettings)(predictor.set_config)
    return service


def _query(body: PredictRequest) -> LengthQuery:
    return LengthQuery(tenant=body.tenant, max_tokens=body.max_tokens, prompt_ids=tuple(body.prompt_token_ids or ()),
                       text=body.prompt, template=body.template, true_length=body.true_length)
