"""OpenTelemetry tracing for a kvmesh service process (docs/observability.md).

`setup()` installs a tracer provider only when a destination is configured (a span file, an OTLP
endpoint); otherwise tracing stays off: no provider, no exporter thread, and `tracer()` is None, so
the helpers below return at once without creating a span. Spans go out through a batch processor
(its own thread), so a request never waits on an exporter.

    setup("engine", "engine-p0", config)          # once, in the service process
    with span("route", kind=SpanKind.CLIENT):     # a span around awaited work, current for its calls
        ...
    s = start("prefill", kind=SpanKind.CLIENT)    # one that is not made current (async generators)
    call(..., headers=headers(s)); finish(s, error)
    record("prefill.queue", start_s, end_s, {...})  # a span after the fact, from timestamps
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]

EXPORT_DELAY_MS = 1000  # spans reach the file or collector within about a second
_tracer: Tracer | None = None
_provider: TracerProvider | None = None


class TracingConfig(Protocol):
    trace_file: str | None
    otlp_endpoint: str | None
    otlp_protocol: str
    trace_sample: float


def setup(service: str, instance: str, config: TracingConfig) -> Tracer | None:
    """Tracing for this process as configured (replacing any earlier setup); None when it is off.
    The provider is kvmesh's own, not OpenTelemetry's global one, so nothing else in the process
    starts tracing because kvmesh does."""
    global _tracer, _provider
    shutdown()
    if not (config.trace_file or config.otlp_endpoint):
        return None
    if not 0.0 <= config.trace_sample <= 1.0:
        raise ValueError(f"trace_sample must be in [0, 1], got {config.trace_sample}")
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.trace_sample)),
                              resource=Resource.create({"service.name": service, "service.instance.id": instance}),
                              shutdown_on_exit=False)
    if config.trace_file:
        provider.add_span_processor(BatchSpanProcessor(SpanFileExporter(config.trace_file),
                                                       schedule_delay_millis=EXPORT_DELAY_MS))
    if config.otlp_endpoint:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(config.otlp_endpoint, config.otlp_protocol),
                                                       schedule_delay_millis=EXPORT_DELAY_MS))
    atexit.register(shutdown)  # flushes what is batched when the process exits
    _provider, _tracer = provider, provider.get_tracer("kvmesh")
    return _tracer


def shutdown() -> None:
    """Export what is batched and turn tracing off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def tracer() -> Tracer | None:
    return _tracer


def enabled() -> bool:
    """Whether spans are being made: callers skip building attributes nobody would record."""
    return _tracer is not None


@contextlib.contextmanager
def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, AttributeValue] | None = None) -> Iterator[Span | None]:
    """A span around the block, current while it runs (calls made inside carry it); it ends with
    status ERROR and an event if the block raises, `abort` if it is cancelled. None when off."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, kind=kind, attributes=attributes, record_exception=False,
                                       set_status_on_exception=False) as current:
        try:
            yield current
        except BaseException as exc:
            failed(current, exc)
            raise


def start(name: str, *, kind: SpanKind = SpanKind.INTERNAL,
          attributes: Mapping[str, AttributeValue] | None = None) -> Span | None:
    """A span that is not made current: for work that spans yields of an async generator, where a
    context attached before a yield cannot be detached after it. End it with `finish`."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, kind=kind, attributes=attributes)


def headers(span_: Span | None) -> dict[str, str]:
    """The W3C trace context of `span_`, for a call made while it is not current."""
    carrier: dict[str, str] = {}
    if span_ is not None:
        propagate.inject(carrier, context=trace.set_span_in_context(span_))
    return carrier


def finish(span_: Span | None, error: BaseException | str | None = None) -> None:
    if span_ is None:
        return
    if error is not None:
        failed(span_, error)
    span_.end()


def failed(span_: Span | None, error: BaseException | str, *, abort: bool = False) -> None:
    """Mark the abort or error path: status ERROR with the reason, and an `abort` event (a
    cancellation, or `abort=True`) or an `error` event."""
    if span_ is None or not span_.is_recording():
        return
    abort = abort or isinstance(error, (asyncio.CancelledError, GeneratorExit))
    reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
    span_.set_status(Status(StatusCode.ERROR, reason))
    span_.add_event("abort" if abort else "error", {"reason": reason})


def fail_current(error: BaseException | str, *, abort: bool = False) -> None:
    """`failed` for the current span (the request's SERVER span, in a handler)."""
    if _tracer is not None:
        failed(trace.get_current_span(), error, abort=abort)


def record(name: str, start_s: float, end_s: float, attributes: Mapping[str, AttributeValue] | None = None,
           error: str | None = None) -> None:
    """A finished span from unix-second timestamps (taken where OpenTelemetry is not, e.g. the
    engine thread), as a child of the current span."""
    if _tracer is None:
        return
    recorded = _tracer.start_span(name, attributes=attributes, start_time=_ns(start_s))
    if error is not None:
        failed(recorded, error)
    recorded.end(end_time=_ns(max(start_s, end_s)))


def annotate(attributes: Mapping[str, AttributeValue | None]) -> None:
    """Set attributes on the current span (those that are None are skipped)."""
    if _tracer is None:
        return
    current_span = trace.get_current_span()
    if current_span.is_recording():
        current_span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def captured() -> otel_context.Context | None:
    """The current trace context, to run later work on the same trace (`task_in`); None when off."""
    return otel_context.get_current() if _tracer is not None else None


def task_in(captured_context: otel_context.Context | None, coroutine) -> asyncio.Task:
    """A task running `coroutine` on the trace `captured_context` was taken from (or on none)."""
    if captured_context is None:
        return asyncio.ensure_future(coroutine)
    carrier = contextvars.copy_context()
    carrier.run(otel_context.attach, captured_context)
    return asyncio.get_running_loop().create_task(coroutine, context=carrier)


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def _otlp_exporter(endpoint: str, protocol: str):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        if not endpoint.rstrip("/").endswith("/v1/traces"):  # a collector's base URL, as OTEL_EXPORTER_OTLP_ENDPOINT
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"otlp_protocol must be 'http/protobuf' or 'grpc', got {protocol!r}")


class SpanLine(msgspec.Struct, kw_only=True):
    """One line of the span file (docs/observability.md)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    kind: str
    start_ns: int
    end_ns: int
    status: str
    status_message: str | None
    attributes: dict[str, Any]
    events: list[dict[str, Any]]


class SpanFileExporter(SpanExporter):
    """Appends finished spans to a JSON-lines file, one write per span, so that several processes
    can share one file (O_APPEND writes of a line do not interleave)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            for finished in spans:
                os.write(self._fd, self._encoder.encode(span_line(finished)) + b"\n")
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def span_line(finished: ReadableSpan) -> SpanLine:
    """A finished SDK span (ReadableSpan) as a line of the span file."""
    resource = finished.resource.attributes
    parent = finished.parent
    return SpanLine(
        trace_id=f"{finished.context.trace_id:032x}", span_id=f"{finished.context.span_id:016x}",
        parent_id=f"{parent.span_id:016x}" if parent is not None else None, name=finished.name,
        service=str(resource.get("service.instance.id") or resource.get("service.name", "")),
        kind=finished.kind.name, start_ns=finished.start_time or 0, end_ns=finished.end_time or 0,
        status=finished.status.status_code.name, status_message=finished.status.description,
        attributes=dict(finished.attributes or {}),
        events=[{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                for e in finished.events])

