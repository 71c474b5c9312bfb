"""Per-request SLOs (time to first token, time between tokens) and how often they are met.

A request names its SLOs in the body (`ttft_ms`, `tbt_ms`), else in headers (`X-KVMesh-TTFT-Ms`,
`X-KVMesh-TBT-Ms`), else gets the configured defaults. Today admission measures each request against
them and counts attainment in `/metrics`; the scheduler's and the engines' request bodies do not take
SLOs yet, and they are the next place these values go (SLO-aware routing, LayerKV's prefill admission).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from .openai_api import bad_request

HEADERS = {"ttft_ms": "X-KVMesh-TTFT-Ms", "tbt_ms": "X-KVMesh-TBT-Ms"}


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None
    tbt_ms: float | None


def slo_of(body_values: dict[str, float | None], headers, defaults: dict[str, float | None]) -> Slo:
    """The request's SLOs: body, then header, then default; a value that is not a positive number is a 400."""
    chosen: dict[str, float | None] = {}
    for name, header in HEADERS.items():
        value: object = body_values.get(name)
        if value is None and header in headers:
            try:
                value = float(headers[header])
            except ValueError:
                raise bad_request(f"the {header} header must be a number of milliseconds", param=name) from None
        if value is not None and not (math.isfinite(value) and value > 0):
            raise bad_request(f"{name} must be a positive number of milliseconds, got {value}", param=name)
        chosen[name] = value if value is not None else defaults.get(name)
    return Slo(**chosen)


@dataclass
class Timing:
    """When a request arrived and when each of its tokens went to the client (monotonic seconds)."""

    arrived: float
    token_times: list[float] = field(default_factory=list)

    def tokens(self, now: float, count: int) -> None:
        self.token_times.extend([now] * count)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrived if self.token_times else None

    @property
    def mean_tbt_s(self) -> float | None:
        times = self.token_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


class SloMetrics:
    """TTFT and mean TBT histograms, and per-SLO attainment counts (met / missed)."""

    def __init__(self, registry: CollectorRegistry):
        buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("kvmesh_admission_ttft_seconds", "Time to first token at the front door",
                              registry=registry, buckets=buckets)
        self.tbt = Histogram("kvmesh_admission_tbt_seconds", "Mean time between tokens of a request",
                             registry=registry, buckets=buckets)
        self.attainment = Counter("kvmesh_admission_slo_requests", "Requests with an SLO, by SLO and whether met",
                                  ["slo", "met"], registry=registry)

    def record(self, slo: Slo, timing: Timing) -> None:
        for name, measured, target in (("ttft", timing.ttft_s, slo.ttft_ms), ("tbt", timing.mean_tbt_s, slo.tbt_ms)):
            if measured is None:
                continue
            (self.ttft if name == "ttft" else self.tbt).observe(measured)
            if target is not None:
                self.attainment.labels(name, str(measured * 1000 <= target).lower()).inc()
