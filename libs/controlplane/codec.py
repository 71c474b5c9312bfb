"""Bodies on the control plane: msgpack for services, JSON for people with curl.

A body labelled msgpack is msgpack, anything else is JSON; the response follows the Accept header,
else the request's own encoding, else JSON.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from .errors import BadRequest, ValidationFailed

MSGPACK = "application/msgpack"
JSON = "application/json"
_MSGPACK_ALIASES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")

T = TypeVar("T")

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def is_msgpack(content_type: str | None) -> bool:
    return bool(content_type) and content_type.split(";")[0].strip().lower() in _MSGPACK_ALIASES


def decode(raw: bytes, content_type: str | None, into: type[T]) -> T:
    """Decode and validate a body; malformed bytes and a wrong shape or type are both a 400,
    told apart by the error type (`invalid_request`, `validation_error`).

    Anything not labelled msgpack is read as JSON, so `curl -d '{...}'` works without a header."""
    msgpack = is_msgpack(content_type)
    try:
        return (msgspec.msgpack if msgpack else msgspec.json).decode(raw, type=into)
    except msgspec.ValidationError as exc:
        raise ValidationFailed(str(exc)) from None
    except msgspec.DecodeError as exc:
        hint = "" if msgpack else f" (bodies are {JSON} or {MSGPACK})"
        raise BadRequest(f"malformed {'msgpack' if msgpack else 'JSON'} body{hint}: {exc}") from None


def response_media(accept: str | None, request_content_type: str | None) -> str:
    """The first of ours that Accept names decides; otherwise answer in the request's own encoding."""
    for part in (accept or "").split(","):
        media = part.split(";")[0].strip().lower()
        if is_msgpack(media):
            return MSGPACK
        if media == JSON:
            return JSON
    return MSGPACK if is_msgpack(request_content_type) else JSON


def encode(value: Any, media: str) -> bytes:
    return _msgpack_encoder.encode(value) if media == MSGPACK else _json_encoder.encode(value)
