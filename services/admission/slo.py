"""Per-request SLOs (time to first token, time between tokens), SLO classes, and admission's
request metrics by class.

A request names its SLO class in the body (`slo_class`), else in the header `X-KVMesh-SLO-Class`,
else its class is `default`. Admission's config `slo_classes` maps class names to SLOs; a class it
does not know is a 400. A request may also name its own SLOs in the body (`ttft_ms`, `tbt_ms`), else
in headers (`X-KVMesh-TTFT-Ms`, `X-KVMesh-TBT-Ms`); what it leaves out comes from its class, then
from `default_ttft_ms` / `default_tbt_ms`. Admission measures each request against them,
counts attainment in `/metrics`, and sends them with every engine call (`targets.ttft_slo_ms`,
`targets.tbt_slo_ms`), where the engine's policies read them; the scheduler does not take them yet (SLO-aware routing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .limits import BoundedQueue
from .openai_api import KvmeshInfo, SamplingFields, bad_request

HEADERS = {"ttft_ms": "X-KVMesh-TTFT-Ms", "tbt_ms": "X-KVMesh-TBT-Ms"}
CLASS_HEADER = "X-KVMesh-SLO-Class"
DEFAULT_CLASS = "default"

Millis = Annotated[float, msgspec.Meta(gt=0)]


class SloClass(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The SLOs of one class of requests (admission's `slo_classes`): a request's defaults."""

    ttft_ms: Millis | None = None
    tbt_ms: Millis | None = None


@dataclass(frozen=True)
class Slo:
    slo_class: str
    ttft_ms: float | None
    tbt_ms: float | None


def slo_defaults(classes: Mapping[str, SloClass], ttft_ms: float | None, tbt_ms: float | None) -> dict[str, SloClass]:
    """The classes a request may name, `default` always among them; a value a class leaves out is
    the service-wide default (`ttft_ms`, `tbt_ms`)."""
    named = {DEFAULT_CLASS: SloClass(), **classes}
    return {name: SloClass(ttft_ms=c.ttft_ms if c.ttft_ms is not None else ttft_ms,
                           tbt_ms=c.tbt_ms if c.tbt_ms is not None else tbt_ms)
            for name, c in named.items()}


def slo_of(body: SamplingFields, headers: Mapping[str, str], classes: Mapping[str, SloClass]) -> Slo:
    """The request's class (body, then header, then `default`) and SLOs (body, then header, then its
    class's); an unknown class, or a value that is not a positive number, is a 400."""
    name = body.slo_class if body.slo_class is not None else headers.get(CLASS_HEADER, DEFAULT_CLASS)
    if name not in classes:
        raise bad_request(f"unknown slo_class {name!r}; the classes served here are: {', '.join(sorted(classes))}",
                          param="slo_class")
    chosen: dict[str, float | None] = {}
    for slo, header in HEADERS.items():
        value: object = getattr(body, slo)
        if value is None and header in headers:
            try:
                value = float(headers[header])
            except ValueError:
                raise bad_request(f"the {header} header must be a number of milliseconds", param=slo) from None
        if value is not None and not (math.isfinite(value) and value > 0):
            raise bad_request(f"{slo} must be a positive number of milliseconds, got {value}", param=slo)
        chosen[slo] = value if value is not None else getattr(classes[name], slo)
    return Slo(slo_class=name, **chosen)


@dataclass
class Timing:
    """When a request arrived and when each of its tokens went to the client (monotonic seconds)."""

    arrived: float
    token_times: list[float] = field(default_factory=list)
    on_first_token: Callable[[float], None] = lambda now: None  # admission's backlog hears of it

    def restart(self) -> None:
        self.token_times = []

    def tokens(self, now: float, count: int) -> None:
        if count and not self.token_times:
            self.on_first_token(now)
        self.token_times.extend([now] * count)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrived if self.token_times else None

    @property
    def gaps_s(self) -> list[float]:
        """Every time between two tokens as the client saw them (0 for tokens that came together)."""
        times = self.token_times
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def mean_tbt_s(self) -> float | None:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    @property
    def e2e_s(self) -> float | None:
        """To the last token."""
        return self.token_times[-1] - self.arrived if self.token_times else None


LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
QUEUES = {"prefill": "prefill_queue", "decode": "decode_queue"}  # queue label -> KvmeshInfo.timings_ms key


class SloMetrics:
    """Admission's request metrics, labelled by SLO class: TTFT, TBT (every gap, and each request's
    mean), end-to-end latency, time in the engines' queues, SLO attainment and outcomes; and
    admission's own queue, read when scraped."""

    def __init__(self, registry: CollectorRegistry, queue: BoundedQueue):
        def latency(name: str, help: str, *labels: str) -> Histogram:
            return Histogram(name, help, ["slo_class", *labels], registry=registry, buckets=LATENCY_BUCKETS)

        self.ttft = latency("kvmesh_admission_ttft_seconds", "Time to first token at the front door")
        self.tbt = latency("kvmesh_admission_tbt_seconds", "Time between two tokens as the client saw them, every gap")
        self.mean_tbt = latency("kvmesh_admission_mean_tbt_seconds", "Mean time between tokens of a request")
        self.e2e = latency("kvmesh_admission_e2e_seconds", "Request start to its last token, as the client saw it")
        self.queued = latency("kvmesh_admission_queue_seconds",
                              "Time a request waited in an engine's queue (prefill: for blocks; decode: from "
                              "the first token to the start of its KV transfer)", "queue")
        self.attainment = Counter("kvmesh_admission_slo_requests", "Requests with an SLO, by SLO and whether met",
                                  ["slo_class", "slo", "met"], registry=registry)
        self.finished = Counter("kvmesh_admission_finished_requests",
                                "Requests answered, by finish_reason (error: answered with an error status after admission "
                                "took it, such as a 503; incomplete: the stream ended without one)",
                                ["slo_class", "finish_reason"], registry=registry)
        Gauge("kvmesh_admission_inflight_requests", "Requests holding a running slot (at the engines)",
              registry=registry).set_function(lambda: queue.running)
        Gauge("kvmesh_admission_queued_requests", "Requests waiting in admission's queue for a running slot",
              registry=registry).set_function(lambda: queue.waiting)

    def record(self, slo: Slo, timing: Timing, served: KvmeshInfo | None, finish_reason: str | None) -> None:
        """One answered request: its latencies, where it queued, its outcome and SLO attainment."""
        by_class = slo.slo_class
        self.finished.labels(by_class, finish_reason or "incomplete").inc()
        for gap in timing.gaps_s:
            self.tbt.labels(by_class).observe(gap)
        if timing.e2e_s is not None:
            self.e2e.labels(by_class).observe(timing.e2e_s)
        for queue, seconds in _queue_times(served).items():
            self.queued.labels(by_class, queue).observe(seconds)
        for name, histogram, measured, target in (("ttft", self.ttft, timing.ttft_s, slo.ttft_ms),
                                                  ("tbt", self.mean_tbt, timing.mean_tbt_s, slo.tbt_ms)):
            if measured is None:
                continue
            histogram.labels(by_class).observe(measured)
            if target is not None:
                self.attainment.labels(by_class, name, str(measured * 1000 <= target).lower()).inc()


def _queue_times(served: KvmeshInfo | None) -> dict[str, float]:
    """Seconds in each engine queue the request went through (a colocated request has no decode queue)."""
    if served is None or served.timings_ms is None:
        return {}
    queues = QUEUES if served.mode == "disaggregated" else {"prefill": QUEUES["prefill"]}
    return {queue: served.timings_ms[key] / 1e3 for queue, key in queues.items() if key in served.timings_ms}
