"""Errors as types: each maps to one HTTP status and one `type` string, here and nowhere else.

A handler raises one of these; the error middleware turns it into
`{"error": {"type", "message", "code"}}` with the status below.
"""

from __future__ import annotations

import msgspec


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str
    code: int


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class KvmeshError(Exception):
    """Base of every error a kvmesh service reports to its caller."""

    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(type=self.type, message=self.message, code=self.status))


class BadRequest(KvmeshError):
    status, type = 400, "invalid_request"


class Unauthorized(KvmeshError):
    status, type = 401, "unauthorized"


class Forbidden(KvmeshError):
    status, type = 403, "forbidden"


class NotFound(KvmeshError):
    status, type = 404, "not_found"


class MethodNotAllowed(KvmeshError):
    status, type = 405, "method_not_allowed"


class PayloadTooLarge(KvmeshError):
    status, type = 413, "payload_too_large"


class ValidationFailed(KvmeshError):
    """A body of the right encoding but the wrong shape, types or values (400, as OpenAI and vLLM answer)."""

    status, type = 400, "validation_error"


class ServiceUnavailable(KvmeshError):
    status, type = 503, "service_unavailable"


class RemoteError(KvmeshError):
    """What a client raises when the service it called answered with an error body."""

    def __init__(self, status: int, type: str, message: str, url: str = ""):
        super().__init__(message)
        self.status, self.type, self.url = status, type, url

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message} ({self.url})"


class ServiceUnreachable(KvmeshError):
    """What a client raises when no answer came back at all (refused, reset, timed out)."""

    status, type = 503, "service_unreachable"


_BY_STATUS = {cls.status: cls for cls in (BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed,
                                           PayloadTooLarge,
                                           ServiceUnavailable)}


def type_for_status(status: int) -> str:
    """The error `type` for a bare HTTP status (aiohttp's own 404/405/413 and the like)."""
    cls = _BY_STATUS.get(status)
    if cls is not None:
        return cls.type
    return "invalid_request" if 400 <= status < 500 else "internal_error"
