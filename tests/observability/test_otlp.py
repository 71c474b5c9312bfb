"""OTLP export reaches a collector, over HTTP (protobuf) and over gRPC: real receivers on loopback
decode what kvmesh's tracing sends."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvmesh.observability import tracing


@dataclass
class Settings:
    otlp_endpoint: str
    otlp_protocol: str
    trace_file: str | None = None
    trace_sample: float = 1.0


def span_names(requests: list[trace_service_pb2.ExportTraceServiceRequest]) -> list[tuple[str, str]]:
    """(service.name, span name) of every span received."""
    found = []
    for request in requests:
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            found += [(service, s.name) for scope in resource_spans.scope_spans for s in scope.spans]
    return found


def emit_and_flush(protocol: str, endpoint: str) -> None:
    tracing.setup("engine", "engine-p0", Settings(otlp_endpoint=endpoint, otlp_protocol=protocol))
    with tracing.span("POST /v1/generate"):
        tracing.record("prefill.queue", 10.0, 10.5)
    tracing.shutdown()


def test_spans_go_to_an_otlp_http_collector():
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        emit_and_flush("http/protobuf", f"http://127.0.0.1:{server.server_port}")  # the base URL, as a collector's
    finally:
        server.shutdown()
    assert sorted(span_names(received)) == [("engine", "POST /v1/generate"), ("engine", "prefill.queue")]


def test_spans_go_to_an_otlp_grpc_collector():
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the gRPC service's method name
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        emit_and_flush("grpc", f"http://127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert sorted(span_names(received)) == [("engine", "POST /v1/generate"), ("engine", "prefill.queue")]


@pytest.fixture(autouse=True)
def tracing_off_after():
    yield
    tracing.shutdown()
