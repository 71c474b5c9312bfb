"""The one way every kvmesh service is written.

A `Service` holds typed routes; `build()` turns them into an aiohttp application that
- decodes and validates bodies, query strings and path parameters against msgspec structs
  (malformed bytes 400 `invalid_request`, wrong shape or type 400 `validation_error`, oversize 413);
- checks the service token on internal routes (missing 401, wrong 403);
- answers every error as `{"error": {"type", "message", "code"}}`, never an HTML page or a bare 500;
- carries W3C trace context from the incoming request into the handler, so calls it makes go on
  the same trace, and (tracing on) makes the request's SERVER span;
- counts requests and latencies per route and status for `GET /metrics`;
- serves `GET /health`, `GET /ready` (the service's own readiness checks), `GET /metrics` and
  `GET /openapi.json`, generated from the same route table.

    service = Service("kvmeta", config)

    @service.route("POST", "/v1/workers", body=WorkerRegistration, response=Worker)
    async def register(request, body: WorkerRegistration) -> Worker: ...
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from aiohttp import web
from opentelemetry import context, propagate, trace
from opentelemetry.trace import Span, SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from . import codec
from .config import ServiceConfig
from .errors import ErrorBody, ErrorDetail, Forbidden, KvmeshError, ServiceUnavailable, Unauthorized, ValidationFailed, type_for_status
from .openapi import openapi_document

log = logging.getLogger(__name__)

UNTRACED = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: noise in every trace

Handler = Callable[..., Awaitable[Any]]


class ServerSpans(Protocol):
    """What makes each request's SERVER span, given to `Service.build` (kvmesh.observability.tracing
    is one: `kvmesh serve` passes it). Without it a service carries trace context but makes no span."""

    def enabled(self) -> bool: ...

    def span(self, name: str, *, kind: SpanKind, attributes: dict[str, Any]) -> AbstractContextManager[Span | None]: ...

    def failed(self, span: Span | None, error: BaseException | str) -> None: ...

ReadinessCheck = Callable[[], Awaitable[None]]
Lifespan = Callable[[web.Application], AsyncIterator[None]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    body: type | None = None
    query: type | None = None
    params: type | None = None
    response: Any = None
    internal: bool = True
    summary: str = ""
    span_name: str | None = None
    media: tuple[str, ...] = (codec.JSON, codec.MSGPACK)  # what it reads and answers in (errors included)
    reads: type | None = None  # a body the handler reads and checks itself (its own errors), published


class Health(msgspec.Struct, kw_only=True):
    status: str
    service: str


class Service:
    def __init__(self, name: str, config: ServiceConfig):
        self.name = name
        self.config = config
        self.routes: list[Route] = []
        self._declared: dict[tuple[str, str], Route] = {}
        self.metrics = CollectorRegistry()
        self._readiness: list[ReadinessCheck] = []
        self._lifespans: list[Lifespan] = []
        self._shutdown_hooks: list[Callable[[], Awaitable[None]]] = []
        self._spans: ServerSpans | None = None
        self._translations: list[tuple[type[BaseException], Callable[[BaseException], KvmeshError]]] = []
        self._requests = Counter("kvmesh_http_requests", "HTTP requests served, by route and status",
                                 ["route", "method", "status"], registry=self.metrics)
        self._latency = Histogram("kvmesh_http_request_duration_seconds", "HTTP request latency by route",
                                  ["route", "method"], registry=self.metrics,
                                  buckets=(.0002, .0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10))
        self.route("GET", "/health", response=Health, internal=False, summary="Liveness")(self._health)
        self.route("GET", "/ready", response=Health, internal=False, summary="Readiness")(self._ready)
        self.route("GET", "/metrics", internal=False, summary="Prometheus metrics")(self._metrics)
        self.route("GET", "/openapi.json", internal=False, summary="This API")(self._openapi)

    # -- declaring the service --------------------------------------------------------------------

    def route(self, method: str, path: str, *, body: type | None = None, query: type | None = None,
              params: type | None = None, response: Any = None, internal: bool = True,
              summary: str = "", span_name: str | None = None,
              media: tuple[str, ...] = (codec.JSON, codec.MSGPACK),
              reads: type | None = None) -> Callable[[Handler], Handler]:
        """Register a handler. It receives the request and, when declared, `body`, `query` and
        `params` already validated; it returns a struct (encoded for the caller), None (204), or an
        aiohttp response of its own (streams: then `media` says what it answers in). A handler that
        reads its body itself, to answer errors in a shape of its own, names its struct in `reads`
        for the description. Its requests are traced as SERVER spans named `span_name`, or "METHOD path"."""

        def register(handler: Handler) -> Handler:
            route = Route(method.upper(), path, handler, body, query, params, response, internal,
                          summary or (handler.__doc__ or "").strip().split("\n")[0], span_name, media, reads)
            self.routes.append(route)
            self._declared[(route.method, path)] = route
            return handler

        return register

    def readiness(self, check: ReadinessCheck) -> ReadinessCheck:
        """A check `GET /ready` runs; it raises (ideally ServiceUnavailable) when not ready."""
        self._readiness.append(check)
        return check

    def lifespan(self, fn: Lifespan) -> Lifespan:
        """An async generator run around the app's life: setup before `yield`, teardown after."""
        self._lifespans.append(fn)
        return fn

    def on_shutdown(self, hook: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """Run when shutdown starts, before in-flight requests are awaited: end long-lived streams here."""
        self._shutdown_hooks.append(hook)
        return hook

    def translate(self, exc_type: type[BaseException], to: Callable[[BaseException], KvmeshError]) -> None:
        """Map a library's exception (say, Redis unreachable) to a kvmesh error in one place."""
        self._translations.append((exc_type, to))

    def build(self, spans: ServerSpans | None = None) -> web.Application:
        self._spans = spans
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._trace_context, self._count, self._errors])
        for route in self.routes:
            app.router.add_route(route.method, route.path, self._endpoint(route))
        app.cleanup_ctx.extend(self._lifespans)
        for hook in self._shutdown_hooks:
            app.on_shutdown.append(lambda _app, hook=hook: hook())
        return app

    # -- middlewares ------------------------------------------------------------------------------

    @web.middleware
    async def _trace_context(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        incoming = propagate.extract(request.headers)
        token = context.attach(incoming)
        try:
            spans = self._spans
            if spans is None or not spans.enabled() or request.path in UNTRACED:
                return await handler(request)
            route = _route_of(request)
            declared = self._declared.get((request.method, route))
            # An internal call starts no trace of its own: heartbeats, watches and leases made in
            # the background would bury the one trace per client request.
            if declared is None or (declared.internal and not trace.get_current_span(incoming).get_span_context().is_valid):
                return await handler(request)
            with spans.span(declared.span_name or f"{request.method} {route}", kind=SpanKind.SERVER,
                              attributes={"http.request.method": request.method, "http.route": route}) as span:
                response = await handler(request)
                span.set_attribute("http.response.status_code", response.status)
                if response.status >= 500:
                    spans.failed(span, f"answered HTTP {response.status}")
                return response
        finally:
            context.detach(token)

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = _route_of(request)
        response = await handler(request)
        self._latency.labels(route, request.method).observe(time.perf_counter() - started)
        self._requests.labels(route, request.method, str(response.status)).inc()
        return response

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except KvmeshError as exc:
            return self._error_response(request, exc.status, exc.type, exc.message)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._error_response(request, exc.status, type_for_status(exc.status), _explain(request, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for exc_type, to in self._translations:
                if isinstance(exc, exc_type):
                    error = to(exc)
                    return self._error_response(request, error.status, error.type, error.message)
            log.exception("%s %s failed", request.method, request.path)
            return self._error_response(request, 500, "internal_error", f"internal error in {self.name}; see its log")

    def _error_response(self, request: web.Request, status: int, type: str, message: str) -> web.Response:
        media = codec.response_media(request.headers.get("Accept"), request.content_type)
        body = ErrorBody(error=ErrorDetail(type=type, message=message, code=status))
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.Response(status=status, body=codec.encode(body, media), content_type=media, headers=headers)

    # -- one endpoint -----------------------------------------------------------------------------

    def _endpoint(self, route: Route) -> Handler:
        async def endpoint(request: web.Request) -> web.StreamResponse:
            if route.internal:
                self._authorize(request)
            kwargs: dict[str, Any] = {}
            if route.params is not None:
                kwargs["params"] = _convert(dict(request.match_info), route.params, "path")
            if route.query is not None:
                kwargs["query"] = _convert(dict(request.query), route.query, "query string")
            if route.body is not None:
                raw = await read_body(request, self.config.body_timeout_s)
                kwargs["body"] = codec.decode(raw, request.headers.get("Content-Type"), route.body)
            result = await route.handler(request, **kwargs)
            if isinstance(result, web.StreamResponse):
                return result
            if result is None:
                return web.Response(status=204)
            media = codec.response_media(request.headers.get("Accept"), request.content_type)
            return web.Response(body=codec.encode(result, media), content_type=media)

        return endpoint

    def _authorize(self, request: web.Request) -> None:
        expected = self.config.token
        if not expected:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise Unauthorized("this endpoint needs the service token: Authorization: Bearer <token>")
        if not hmac.compare_digest(presented.strip().encode(), expected.encode()):
            raise Forbidden("the service token is not valid for this cluster")

    # -- built-in endpoints -----------------------------------------------------------------------

    async def _health(self, request: web.Request) -> Health:
        return Health(status="ok", service=self.name)

    async def _ready(self, request: web.Request) -> Health:
        for check in self._readiness:
            try:
                await check()
            except KvmeshError:
                raise
            except Exception as exc:
                raise ServiceUnavailable(f"{self.name} is not ready: {exc}") from None
        return Health(status="ready", service=self.name)

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.name, self.routes, secured=bool(self.config.token)))


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's body, if it arrives within `timeout_s`; else a 408 (aiohttp itself waits for a
    slow body as long as it trickles in)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout_s:g} s") from None


def _route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _convert(values: dict[str, str], into: type, where: str) -> Any:
    try:
        return msgspec.convert(values, into, strict=False)
    except msgspec.ValidationError as exc:
        raise ValidationFailed(f"invalid {where}: {exc}") from None


def _explain(request: web.Request, exc: web.HTTPException) -> str:
    if isinstance(exc, web.HTTPNotFound) and request.match_info.route.resource is None:
        return f"no endpoint {request.path}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(exc.allowed_methods))}"
    return exc.text or exc.reason
