"""How the generation routes (`POST /v1/generate`, `/v1/prefill`, `/v1/decode`) answer on both
backends: the request's frames written as they come, as msgpack values one after another, or as
JSON lines when the client asks for JSON."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web

from kvmesh.libs.messages.engine import Frame
from kvmesh.observability import tracing


NDJSON = "application/x-ndjson"


async def write_frames(request: web.Request, frames: asyncio.Queue[Frame], response: web.StreamResponse,
                       on_last: Callable[[Frame], None] | None = None) -> Frame | None:
    """Write frames into `response` (prepared here) until the last; returns it, or None when the client
    went away first. `on_last` sees the last frame before it is written."""
    as_json = any(media in request.headers.get("Accept", "") for media in ("application/json", NDJSON))
    response.content_type = NDJSON if as_json else "application/msgpack"
    try:
        await response.prepare(request)
        while True:
            frame = await frames.get()
            last = frame.finish_reason is not None
            if last and on_last is not None:
                on_last(frame)
            await response.write(msgspec.json.encode(frame) + b"\n" if as_json else msgspec.msgpack.encode(frame))
            if last:
                await response.write_eof()
                return frame
    except ConnectionResetError:  # the client went away mid-stream: nothing to answer
        tracing.fail_current("the client went away mid-stream", abort=True)
        return None
