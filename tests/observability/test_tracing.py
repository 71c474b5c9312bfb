"""observability.tracing and observability.logs in one process: off costs nothing, on writes the
span file of docs/observability.md with correct links, sampling and the abort path."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry import context, propagate

from kvmesh.observability import logs, tracing


@dataclass
class Settings:
    trace_file: str | None = None
    otlp_endpoint: str | None = None
    otlp_protocol: str = "http/protobuf"
    trace_sample: float = 1.0


@pytest.fixture(autouse=True)
def tracing_off_after():
    yield
    tracing.shutdown()


def spans(path: Path) -> list[dict]:
    tracing.shutdown()  # exports what is batched
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_starts_no_thread_and_makes_no_span():
    before = set(threading.enumerate())
    assert tracing.setup("engine", "engine-0", Settings()) is None
    assert tracing.tracer() is None and set(threading.enumerate()) == before
    with tracing.span("route") as span:
        assert span is None
    assert tracing.start("prefill") is None and tracing.headers(None) == {} and tracing.captured() is None
    tracing.record("prefill.queue", 1.0, 2.0)  # nothing to record into, nothing raised
    tracing.finish(None, "ignored")


def test_spans_land_in_the_file_with_their_links(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing.setup("engine", "engine-p0", Settings(trace_file=str(path)))
    with tracing.span("POST /v1/generate", kind=tracing.SpanKind.SERVER) as server:
        tracing.record("prefill.queue", 100.0, 100.25, {"kvmesh.request_id": "r1", "kvmesh.tbt_ms": [1.5, 2.0]})
        tracing.annotate({"kvmesh.engine": "engine-p0", "kvmesh.missing": None})
        client = tracing.start("kvmeta call", kind=tracing.SpanKind.CLIENT)
        sent = tracing.headers(client)
        tracing.finish(client)
    queue, call, root = spans(path)
    assert root["name"] == "POST /v1/generate" and root["kind"] == "SERVER" and root["parent_id"] is None
    assert root["service"] == "engine-p0" and root["attributes"] == {"kvmesh.engine": "engine-p0"}
    assert queue["parent_id"] == call["parent_id"] == root["span_id"]
    assert queue["trace_id"] == call["trace_id"] == root["trace_id"] == f"{server.get_span_context().trace_id:032x}"
    assert (queue["start_ns"], queue["end_ns"]) == (100_000_000_000, 100_250_000_000)
    assert queue["attributes"] == {"kvmesh.request_id": "r1", "kvmesh.tbt_ms": [1.5, 2.0]}
    _, trace_id, parent_id, flags = sent["traceparent"].split("-")
    assert (trace_id, parent_id) == (root["trace_id"], call["span_id"]) and int(flags, 16) & 1  # sampled


def test_the_abort_path_marks_the_span(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing.setup("admission", "admission", Settings(trace_file=str(path)))
    with pytest.raises(asyncio.CancelledError):
        with tracing.span("admission"):
            raise asyncio.CancelledError
    with tracing.span("admission"):
        tracing.fail_current("engine engine-d0 failed: no frame within 5s")
    cancelled, failed = spans(path)
    assert cancelled["status"] == "ERROR" and [e["name"] for e in cancelled["events"]] == ["abort"]
    assert failed["status"] == "ERROR" and failed["status_message"] == "engine engine-d0 failed: no frame within 5s"
    assert failed["events"][0]["name"] == "error"


def test_sampling_starts_no_trace_at_zero_but_follows_a_sampled_parent(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing.setup("engine", "engine-0", Settings(trace_file=str(path), trace_sample=0.0))
    with tracing.span("not sampled"):
        pass
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    token = context.attach(propagate.extract({"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}))
    try:
        with tracing.span("child of a sampled caller"):
            pass
    finally:
        context.detach(token)
    (only,) = spans(path)
    assert only["name"] == "child of a sampled caller" and only["trace_id"] == trace_id
    assert only["parent_id"] == "00f067aa0ba902b7"


def test_json_logs_carry_the_trace_and_request_ids(tmp_path):
    tracing.setup("admission", "admission", Settings(trace_file=str(tmp_path / "spans.jsonl")))
    logs.configure("admission", "INFO", "json")
    out = io.StringIO()
    logging.getLogger().handlers[0].setStream(out)
    try:
        with tracing.span("admission") as span, logs.request_context("chatcmpl-1"):
            logging.getLogger("kvmesh.test").info("routed to %s", "engine-p0", extra={"attempt": 1})
    finally:
        logging.getLogger().handlers.clear()
    line = json.loads(out.getvalue())
    assert line["message"] == "routed to engine-p0" and line["level"] == "INFO" and line["service"] == "admission"
    assert line["trace_id"] == f"{span.get_span_context().trace_id:032x}" and line["request_id"] == "chatcmpl-1"
    assert line["attempt"] == 1


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="trace_sample"):
        tracing.setup("engine", "e", Settings(trace_file=str(tmp_path / "x"), trace_sample=1.5))
    with pytest.raises(ValueError, match="otlp_protocol"):
        tracing.setup("engine", "e", Settings(otlp_endpoint="http://127.0.0.1:4318", otlp_protocol="thrift"))
    with pytest.raises(ValueError, match="log_format"):
        logs.configure("engine", "INFO", "xml")
