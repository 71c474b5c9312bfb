"""The client every service uses to call another: pooled connections, timeouts, bounded retries.

- Bodies go out as msgpack and come back decoded into the type the caller names.
- The service token rides on every call; so does the W3C trace context of the calling task.
- Idempotent calls (GET, PUT, DELETE, or `idempotent=True`) are retried on connection failures,
  timeouts and 502/503/504, with exponential backoff and full jitter; other calls are tried once,
  because a retry could apply them twice.
- An error answer raises `RemoteError` (status, type, message); no answer raises
  `ServiceUnreachable`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiohttp
import msgpack
import msgspec
from opentelemetry import propagate

from . import codec
from .errors import ErrorBody, KvmeshError, RemoteError, ServiceUnreachable

T = TypeVar("T")

_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_RETRY_STATUS = frozenset({502, 503, 504})
# One value of a msgpack stream may not claim more (a prefill's last frame, KV handle included, is tens
# of KB): a peer that claims gigabytes is refused once this much is buffered.
MAX_FRAME_BYTES = 16 << 20
# What a peer that went away looks like: no connection, a timeout, or an answer cut short of what its
# framing promised (a server killed mid-stream: aiohttp's ClientPayloadError is no ConnectionError).
_NO_ANSWER = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class ServiceClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 5.0, retries: int = 3,
                 backoff: float = 0.05, max_connections: int = 64):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.retries = retries
        self.backoff = backoff
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=30))
        return self._session

    @property
    def longest_call_s(self) -> float:
        """The longest one call() can take: every attempt timing out, with the longest backoffs between."""
        return self.timeout.total * (1 + self.retries) + self.backoff * (2 ** self.retries - 1)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> ServiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Accept": codec.MSGPACK}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        propagate.inject(headers)
        if extra:
            headers.update(extra)
        return headers

    async def call(self, method: str, path: str, body: Any = None, *, into: type[T] | None = None,
                   params: dict[str, Any] | None = None, idempotent: bool | None = None,
                   timeout: float | None = None) -> T | None:
        """One call; returns the decoded answer (None for 204) or raises RemoteError/ServiceUnreachable."""
        method = method.upper()
        attempts = 1 + (self.retries if (method in _IDEMPOTENT if idempotent is None else idempotent) else 0)
        data = None if body is None else codec.encode(body, codec.MSGPACK)
        headers = self.headers({"Content-Type": codec.MSGPACK} if data is not None else None)
        query = {k: _query_value(v) for k, v in (params or {}).items() if v is not None}
        url = self.base_url + path
        request_timeout = aiohttp.ClientTimeout(total=timeout) if timeout else self.timeout
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                async with self.session.request(method, url, data=data, headers=headers, params=query,
                                                timeout=request_timeout) as response:
                    raw = await response.read()
                    if response.status in _RETRY_STATUS and not last:
                        await self._sleep(attempt)
                        continue
                    return _answer(response, raw, into, url)
            except _NO_ANSWER as exc:
                if last:
                    raise ServiceUnreachable(f"{method} {url} got no answer after {attempts} attempt(s): "
                                             f"{type(exc).__name__}: {exc}") from exc
                await self._sleep(attempt)
        raise AssertionError("unreachable")

    async def events(self, path: str, into: type[T], *, params: dict[str, Any] | None = None) -> AsyncIterator[T]:
        """Server-sent events from `path`, each event's JSON data decoded into `into`.

        Ends when the server closes the stream; raises ServiceUnreachable or RemoteError like call().
        """
        url = self.base_url + path
        headers = self.headers({"Accept": "text/event-stream"})
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout.total, sock_read=None)
        try:
            async with self.session.get(url, headers=headers, params=params, timeout=timeout) as response:
                if response.status != 200:
                    _answer(response, await response.read(), None, url)
                data: list[bytes] = []
                async for line in response.content:
                    line = line.rstrip(b"\r\n")
                    if line.startswith(b"data:"):
                        data.append(line[5:].lstrip(b" "))
                    elif not line and data:
                        yield msgspec.json.decode(b"\n".join(data), type=into)
                        data = []
        except _NO_ANSWER as exc:
            raise ServiceUnreachable(f"event stream {url} broke: {type(exc).__name__}: {exc}") from exc

    async def frames(self, path: str, body: Any, into: type[T], headers: dict[str, str] | None = None) -> AsyncIterator[T]:
        """POST `body` and decode the streamed answer: msgpack values one after another, each into `into`.
        `headers` go with the call (say, the trace context of a span that is not current).

        Not retried (the call starts work on the server). Raises RemoteError or ServiceUnreachable
        like call()."""
        url = self.base_url + path
        headers = self.headers({"Content-Type": codec.MSGPACK, **(headers or {})})
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout.total, sock_read=None)
        try:
            async with self.session.post(url, data=codec.encode(body, codec.MSGPACK), headers=headers,
                                         timeout=timeout) as response:
                if response.status != 200:
                    _answer(response, await response.read(), None, url)
                unpacker, fed = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME_BYTES), 0
                async for chunk in response.content.iter_any():
                    try:
                        unpacker.feed(chunk)
                        values = [msgspec.convert(value, into) for value in unpacker]
                    except (msgpack.UnpackException, ValueError, msgspec.ValidationError) as exc:
                        raise RemoteError(502, "invalid_response", f"a frame of the stream is not a {into.__name__}: "
                                          f"{type(exc).__name__}: {exc}", url) from None
                    fed += len(chunk)
                    for value in values:
                        yield value
                if unpacker.tell() != fed:
                    raise RemoteError(502, "invalid_response", f"the stream ended inside a frame ({fed - unpacker.tell()} "
                                      "bytes of it)", url)
        except _NO_ANSWER as exc:
            raise ServiceUnreachable(f"stream {url} broke: {type(exc).__name__}: {exc}") from exc

    async def _sleep(self, attempt: int) -> None:
        await asyncio.sleep(random.uniform(0, self.backoff * 2 ** attempt))


def _answer(response: aiohttp.ClientResponse, raw: bytes, into: type | None, url: str) -> Any:
    content_type = response.headers.get("Content-Type")
    if response.status >= 400:
        try:
            error = codec.decode(raw, content_type, ErrorBody).error
        except KvmeshError:
            raise RemoteError(response.status, "http_error", raw[:200].decode(errors="replace"), url) from None
        raise RemoteError(response.status, error.type, error.message, url)
    if response.status == 204 or into is None:
        return None
    try:
        return codec.decode(raw, content_type, into)
    except KvmeshError as exc:
        raise RemoteError(502, "invalid_response", f"answer did not match {into}: {exc.message}", url) from None


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
