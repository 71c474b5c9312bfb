"""Logging for a service process: text lines, or JSON lines that carry the trace, span and
request ids, so a log search and a trace point at each other.

    configure("engine-p0", "INFO", "json")
    with request_context("cmpl-1f3a"):    # log records inside carry request_id
        log.info("...")
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import time
from collections.abc import Iterator

import msgspec
from opentelemetry import trace

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvmesh_request_id", default=None)
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def configure(instance: str, level: str, fmt: str = "text") -> None:
    """Replace the root logger's handlers with one on stderr in `fmt` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(instance))
    elif fmt == "text":
        handler.setFormatter(logging.Formatter(f"%(asctime)s {instance} %(levelname)s %(name)s: %(message)s"))
    else:
        raise ValueError(f"log_format must be 'text' or 'json', got {fmt!r}")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Log records made inside (in this task, and tasks it starts) carry `request_id`."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, service, logger, message, trace_id/span_id of the
    current span, request_id, the exception if any, and whatever `extra=` the call passed."""

    def __init__(self, instance: str):
        super().__init__()
        self.instance = instance
        self._encoder = msgspec.json.Encoder(enc_hook=repr)  # an extra= value JSON cannot carry

    converter = time.gmtime  # UTC, as the Z says

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "service": self.instance, "logger": record.name,
                "message": record.getMessage()}
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            line["trace_id"], line["span_id"] = f"{context.trace_id:032x}", f"{context.span_id:016x}"
        request_id = getattr(record, "request_id", None) or _request_id.get()
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        line.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and k not in line})
        return self._encoder.encode(line).decode()
