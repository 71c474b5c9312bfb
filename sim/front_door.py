"""Admission's front door for simulated requests: each arrival checked as the admission service checks
it, in its order (services/admission/openai_routes.py), by the same policies (policies/admission):

1. the API key's token bucket: over it, refused (`rate_limit`, the service's 429 rate_limit_exceeded);
2. the wait it can expect for its first token behind those held without one, against its TTFT SLO or
   `max_wait_s`: past it, refused (`behind`, the service's 429 queue_full "the cluster is behind");
3. held from here to its first token (the backlog), and its output length predicted as the predictor
   service predicts it (policies/length: the arrival-rate estimate of every prediction asked, Eq. 4's
   confidence at that rate, the predictor by name with its padding; the range told to the engines as
   admission tells them, predicted_range);
4. a slot in the bounded queue: run now, wait in arrival order, or refused (`queue_full`).
A request that ends frees its slot for the longest-waiting one, and its actual length goes to the
predictor (admission's observe). No events here: sim/admission.py drives it in the cluster's loop."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.policies.admission import Admit, AdmissionLimits, AdmissionQueue, Backlog, RateLimiter, behind_by
from kvmesh.policies.length import LengthQuery, adaptive_confidence, registry
from kvmesh.policies.length.arrival_rate import ArrivalRate, arrive, rate_at
from kvmesh.policies.length.padding import predicted_range

from .request import SimRequest

TENANT = "sim"   # admission names the model as the predictor's tenant; the simulator serves one model
API_KEY = "sim"  # every simulated client sends the same API key
REFUSALS = ("rate_limit", "behind", "queue_full")
RATE_WINDOW_S = 10.0  # the predictor service's default rate_window_s


@dataclass(frozen=True, slots=True)
class PredictorSettings:
    """The predictor service's config: the predictor by name (policies/length/registry.py; not
    `embedding`, which reads prompt text), its arrival rate's window, and the max_tokens every client
    sends (the cap of a prediction)."""

    name: str
    max_tokens: int
    rate_window_s: float = RATE_WINDOW_S

    def __post_init__(self) -> None:
        if self.name == "embedding":
            raise ValueError("the embedding predictor reads a prompt's text, which simulated requests have not")
        if self.max_tokens < 1 or not self.rate_window_s > 0:
            raise ValueError(f"max_tokens must be >= 1 and the rate window > 0 s, got {self.max_tokens} and "
                             f"{self.rate_window_s}")


class FrontDoor:
    def __init__(self, limits: AdmissionLimits = AdmissionLimits(), predictor: PredictorSettings | None = None):
        self.limits = limits
        self.limiter = RateLimiter(limits.requests_per_s, limits.burst)
        self.backlog = Backlog()
        self.queue: AdmissionQueue[SimRequest] = AdmissionQueue(limits.max_running, limits.max_queued)
        self.settings = predictor
        self.predictor = None if predictor is None else registry.resolve(predictor.name)()
        self.arrivals = ArrivalRate()
        self.refused: dict[str, str] = {}  # request id -> REFUSALS

    def arrive(self, request: SimRequest, now: float) -> Admit | str:
        """`request` at the door at `now`: Admit.RUN or Admit.WAIT, or the reason it was refused. Its
        SLOs (admission's defaults where it names none) and prediction are written into it."""
        limits = self.limits
        if self.limiter.take(API_KEY, now):
            return self._refuse(request, "rate_limit")
        if request.ttft_slo_ms is None:
            request.ttft_slo_ms = limits.default_ttft_ms
        if request.tbt_slo_ms is None:
            request.tbt_slo_ms = limits.default_tbt_ms
        if behind_by(self.backlog.expected_wait_s(now), request.ttft_slo_ms, limits.max_wait_s) is not None:
            return self._refuse(request, "behind")
        self.backlog.join(now)
        if self.predictor is not None:
            self._predict(request, now)
        admit = self.queue.arrive(request)
        if admit is Admit.FULL:
            self.backlog.left(now)
            return self._refuse(request, "queue_full")
        return admit

    def first_token(self, now: float) -> None:
        """A request let in got its first token at `now` (calls in time order)."""
        self.backlog.answered(now)

    def finished(self, request: SimRequest) -> SimRequest | None:
        """`request` ended with all its tokens: its slot goes to the request that runs next, if one waits."""
        if self.predictor is not None:
            self.predictor.observe(LengthQuery(tenant=TENANT, max_tokens=max(request.num_generated, 1)),
                                   request.num_generated)
        return self.queue.release()

    def _predict(self, request: SimRequest, now: float) -> None:
        """As the predictor service's /v1/predict: the arrival counted, then the confidence at the rate."""
        settings = self.settings
        self.arrivals = arrive(self.arrivals, now, settings.rate_window_s)
        confidence = adaptive_confidence(rate_at(self.arrivals, now, settings.rate_window_s))
        query = LengthQuery(tenant=TENANT, max_tokens=settings.max_tokens, true_length=request.max_tokens)
        prediction = self.predictor.predict(query, confidence)
        request.predicted_output_len = prediction.estimated
        request.predicted_output_low, request.predicted_output_median = predicted_range(
            prediction.predicted, prediction.padding, settings.max_tokens)

    def _refuse(self, request: SimRequest, reason: str) -> str:
        self.refused[request.request_id] = reason
        return reason
