"""Admission: the public, OpenAI-compatible front door (docs/serving.md).

`POST /v1/completions`, `POST /v1/chat/completions` (server-sent events when `stream`), `GET /v1/models`.
Per request, in order: API key (401), the key's rate limit (429 + Retry-After), the body (400), the
model (404), tokenization with the model's own tokenizer and the context limit (400), the wait it can
expect for its first token against its TTFT SLO or `max_wait_s` (429 + Retry-After), a place in the
bounded queue (429 + Retry-After), then the journey through the cluster (lifecycle.py). Every error
of a public route is OpenAI's shape (openai_api.py); a client that goes away aborts the request on
every engine that holds it. `GET`/`PUT /v1/upstreams` swap the scheduler or the length predictor
for another service speaking the same API while requests flow (upstreams.py).
"""

from __future__ import annotations

from typing import Literal

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kvmesh.libs.controlplane import Service, ServiceConfig, read_body
from kvmesh.libs.controlplane.codec import JSON
from kvmesh.libs.messages.engine import Targets
from kvmesh.libs.messages.predictor import PredictedLength
from kvmesh.observability import logs, tracing

from .engine_client import EngineClients
from .lifecycle import Generation, Lifecycle
from .limits import Backlog, BoundedQueue, QueueFull, RateLimiter
from .openai_api import (ChatCompletionRequest, CompletionRequest, Model, ModelList, OpenAIError, bad_request,
                         chat_checks, completion_checks, decode_body, messages_of, prompt_of, sampling_of)
from .predictor_client import with_predicted_lengths
from .responses import Answer, json_response, stream, whole
from .slo import Slo, SloClass, SloMetrics, Timing, slo_defaults, slo_of
from .tokenizers import Models, ModelTokenizer
from .upstreams import UpstreamChange, Upstreams, UpstreamSettings

log = logging.getLogger(__name__)

OPENAI = (JSON,)  # the OpenAI routes read and answer JSON only, errors in OpenAI's shape included

DISCONNECT_POLL_S = 0.1  # how soon a client that went away is noticed while nothing is written to it


class Config(ServiceConfig, kw_only=True):
    port: int = 8100
    scheduler_url: str = "http://127.0.0.1:8102"
    # The length predictor (CacheOpt): each request's output length to allocate for goes to the
    # engines; none configured, or one that fails or takes longer than predict_timeout_s: no prediction.
    predictor_url: str | None = None
    predict_timeout_s: float = 0.5
    # API keys: `api_key` (KVMESH_API_KEY), `api_keys`, and `api_key_file` (one key a line, `#` comments)
    # all count. With none, every public request is refused: admission is never open by default.
    api_key: str | None = None
    api_keys: list[str] = []
    api_key_file: str | None = None
    # A tenant's limit, off unless set: a per-key limit on by default refused most of a benchmark
    # client's burst (vLLM's sends every prompt at once) on a cluster with room to queue it.
    requests_per_s: float = 0.0         # per API key, on average; 0: no limit
    burst: float = 40.0                 # per API key, at once
    max_running: int = 64               # requests at the engines at once
    max_queued: int = 4096              # more wait in admission, in arrival order; beyond: 429
    queue_retry_after_s: float = 1.0
    # Overload: a request that can expect to wait longer than its TTFT SLO, or than this without one,
    # behind the requests ahead of it for their first tokens gets a 429 (Backlog in limits.py); None: no bound.
    max_wait_s: float | None = 30.0
    default_ttft_ms: float | None = None
    default_tbt_ms: float | None = None
    slo_classes: dict[str, SloClass] = {}  # by name: a request's `slo_class` gives its default SLOs
    max_retries: int = 2                # engines tried again when one fails before the first token
    transfer_mode: Literal["pull", "push"] = "pull"  # how KV moves prefill -> decode (KVDirect 4.3)
    route_timeout_s: float = 5.0        # a scheduler call
    scheduler_wait_s: float = 10.0      # a scheduler that does not answer (restarting) is asked again this long
    connect_timeout_s: float = 5.0      # connecting to an engine
    stall_timeout_s: float = 300.0      # an engine that sends no frame for this long has failed
    # A streaming client that takes none of its answer for this long (it never reads) is gone: the
    # request is aborted on its engines and its slot freed, rather than held for as long as it sits.
    client_write_timeout_s: float = 30.0
    models_refresh_s: float = 1.0       # how stale the list of served models may be

    def __post_init__(self) -> None:
        self.keys()  # an unreadable key file is a configuration error, reported at start

    def keys(self) -> list[str]:
        keys = [k for k in [self.api_key, *self.api_keys] if k]
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"cannot read api_key_file {self.api_key_file}: {exc}") from None
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return keys


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check: what to generate and how to answer."""

    generation: Generation
    tokenizer: ModelTokenizer
    stream: bool
    include_usage: bool
    slo: Slo
    prompt_text: str | None = None  # for the length predictor: the prompt as text, when it came as text


def build_service(config: Config) -> Service:
    service = Service("admission", config)
    keys = config.keys()
    if not keys:
        log.warning("no API key is configured (KVMESH_API_KEY, api_keys, api_key_file): every request is refused")
    limiter = RateLimiter(config.requests_per_s, config.burst)
    queue = BoundedQueue(config.max_running, config.max_queued)
    backlog = Backlog()
    upstreams = Upstreams(config.scheduler_url, config.predictor_url, config.token, config.route_timeout_s,
                          config.predict_timeout_s, service.metrics)
    engines = EngineClients(config.token, config.connect_timeout_s, abort_timeout_s=config.route_timeout_s)
    models = Models(upstreams, engines, config.models_refresh_s)
    lifecycle = Lifecycle(upstreams, engines, config.max_retries, config.stall_timeout_s, config.transfer_mode,
                          config.scheduler_wait_s)
    slo_metrics = SloMetrics(service.metrics, queue)
    defaults = slo_defaults(config.slo_classes, config.default_ttft_ms, config.default_tbt_ms)

    @service.lifespan
    async def clients(app: web.Application) -> AsyncIterator[None]:
        yield
        await engines.close()
        await upstreams.close()

    @service.readiness
    async def scheduler_answers() -> None:
        await upstreams.scheduler.cluster()

    def authenticate(request: web.Request) -> str:
        if not keys:
            raise OpenAIError(401, "admission has no API key configured: set KVMESH_API_KEY, api_keys or "
                                   "api_key_file", code="invalid_api_key")
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise OpenAIError(401, "you didn't provide an API key: send it as `Authorization: Bearer <key>`",
                              code="invalid_api_key")
        matches = [hmac.compare_digest(presented.encode(), key.encode()) for key in keys]
        if not any(matches):
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        return presented

    def public(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """Key and rate limit first; every error in OpenAI's shape, never kvmesh's, never a bare 500."""
        async def endpoint(request: web.Request) -> web.StreamResponse:
            try:
                key = authenticate(request)
                wait = limiter.take(key, time.monotonic())
                if wait:
                    raise OpenAIError(429, f"rate limit reached for this API key ({config.requests_per_s:g} "
                                           f"requests/s, burst {config.burst:g})", type="requests",
                                      code="rate_limit_exceeded", retry_after_s=wait)
                return await handler(request)
            except OpenAIError as exc:
                if exc.status >= 500:
                    tracing.fail_current(str(exc))
                return exc.response()
            except web.HTTPException as exc:  # aiohttp's own, e.g. a body over max_body_bytes
                return OpenAIError(exc.status, exc.text or exc.reason).response()
            except Exception:
                log.exception("%s %s failed", request.method, request.path)
                return OpenAIError(500, "internal error in admission; see its log", type="server_error").response()
        endpoint.__doc__ = handler.__doc__
        return endpoint

    def refuse_if_behind(slo: Slo) -> None:
        """A 429 for a request that can expect to wait longer than its TTFT SLO (else max_wait_s) for the
        requests ahead of it to get their first tokens: under overload a queue as long as admission's
        would otherwise hold every request taken for minutes, and the ones after the load for as long."""
        limit = slo.ttft_ms / 1000 if slo.ttft_ms is not None else config.max_wait_s
        wait = backlog.expected_wait_s(time.monotonic())
        if limit is not None and wait is not None and wait > limit:
            raise OpenAIError(429, f"the cluster is behind: a request now can expect to wait {wait:.1f} s for the "
                                   f"{backlog.pending} ahead of it to start answering, over its limit of {limit:g} s",
                              type="requests", code="queue_full", retry_after_s=wait - limit)

    async def prepare_completion(request: web.Request, body: CompletionRequest) -> Prepared:
        completion_checks(body)
        sampling = sampling_of(body, logprobs=body.logprobs is not None)
        prompt = prompt_of(body)
        tokenizer = await models.tokenizer(body.model)
        ids = await asyncio.to_thread(tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return _prepared(request, body, tokenizer, ids, max_tokens, sampling, "prompt", defaults,
                         prompt_text=prompt if isinstance(prompt, str) else None)

    async def prepare_chat(request: web.Request, body: ChatCompletionRequest) -> Prepared:
        chat_checks(body)
        sampling = sampling_of(body, logprobs=bool(body.logprobs))
        messages = messages_of(body)
        tokenizer = await models.tokenizer(body.model)
        try:
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages)
        except Exception as exc:  # the model's template may refuse a conversation (say, roles out of order)
            raise bad_request(f"the model's chat template refused the messages: {exc}", param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = tokenizer.max_model_len - len(ids) if requested is None else requested
        return _prepared(request, body, tokenizer, ids, max_tokens, sampling, "messages", defaults,
                         prompt_text=_conversation_text(messages))

    async def answer(request: web.Request, prepared: Prepared, chat: bool) -> web.StreamResponse:
        """Hold a place in the queue while the request runs; the client going away cancels it."""
        timing = Timing(time.monotonic())  # the client's clock starts before admission's own queue

        async def respond(generation: Generation, prediction: PredictedLength | None) -> web.StreamResponse:
            """The request's journey through the cluster, once it holds a running slot."""
            reply = _answer(prepared)
            try:
                if prepared.stream:
                    async with contextlib.aclosing(lifecycle.run(generation)) as pieces:
                        response = await stream(request, pieces, reply, chat, prepared.include_usage, timing,
                                                config.client_write_timeout_s)
                else:
                    response = await whole(lambda run: lifecycle.run(generation, run), reply, chat, timing,
                                           config.max_retries)
            except OpenAIError:  # answered with an error status: a finished request all the same
                slo_metrics.record(prepared.slo, timing, reply.served, "error")
                raise
            finally:
                if tracing.enabled():
                    tracing.annotate(_outcome(reply, timing))
            slo_metrics.record(prepared.slo, timing, reply.served, reply.finish_reason)
            # the actual length goes to the predictor in force now, which may not be the one
            # that predicted it if the predictor was swapped meanwhile (each learns from any)
            if prediction is not None and reply.finish_reason in ("stop", "length") \
                    and upstreams.predictor is not None:
                upstreams.predictor.observe(generation.model, len(generation.prompt_ids),
                                            len(timing.token_times), prediction, prepared.prompt_text)
            return response

        async def run() -> web.StreamResponse:
            refuse_if_behind(prepared.slo)
            # counted in the backlog from its check on, with no await between: requests checked
            # together (a burst, each still asking the predictor) see each other
            with backlog.waiting() as first_token:
                timing.on_first_token = first_token
                generation, prediction = prepared.generation, None
                if upstreams.predictor is not None:  # before the queue: the predictor's arrival rate is the arrivals'
                    prediction = await upstreams.predictor.predict(generation.prompt_ids, generation.max_tokens,
                                                                   generation.model, prepared.prompt_text)
                    if prediction is not None:
                        generation = dataclasses.replace(generation, targets=with_predicted_lengths(
                            generation.targets, prediction, generation.max_tokens))
                try:
                    async with queue.slot():
                        return await respond(generation, prediction)
                except QueueFull as exc:
                    raise OpenAIError(429, str(exc), type="requests", code="queue_full",
                                      retry_after_s=config.queue_retry_after_s) from None

        if tracing.enabled():
            tracing.annotate(_request_attributes(prepared))
        with logs.request_context(prepared.generation.request_id):  # the run task copies it
            return await _while_connected(request, run())

    @service.route("GET", "/v1/upstreams", response=UpstreamSettings)
    async def get_upstreams(request: web.Request) -> UpstreamSettings:
        """The scheduler and the length predictor admission calls now."""
        return upstreams.settings()

    @service.route("PUT", "/v1/upstreams", body=UpstreamChange, response=UpstreamSettings)
    async def set_upstreams(request: web.Request, body: UpstreamChange) -> UpstreamSettings:
        """Swap the scheduler or the length predictor for another service speaking the same API, while
        requests flow; one that is not ready or lacks an operation admission calls is refused."""
        return await upstreams.swap(body)

    @service.route("POST", "/v1/completions", internal=False, span_name="admission", media=OPENAI,
                   reads=CompletionRequest)
    @public
    async def completions(request: web.Request) -> web.StreamResponse:
        """OpenAI completions: a prompt (text or token ids) in, text out; SSE when `stream`."""
        body = decode_body(await read_body(request, config.body_timeout_s), CompletionRequest)
        return await answer(request, await prepare_completion(request, body), chat=False)

    @service.route("POST", "/v1/chat/completions", internal=False, span_name="admission", media=OPENAI,
                   reads=ChatCompletionRequest)
    @public
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        """OpenAI chat completions: messages through the model's chat template; SSE when `stream`."""
        body = decode_body(await read_body(request, config.body_timeout_s), ChatCompletionRequest)
        return await answer(request, await prepare_chat(request, body), chat=True)

    @service.route("GET", "/v1/models", internal=False, media=OPENAI)
    @public
    async def list_models(request: web.Request) -> web.Response:
        """The models some live engine serves."""
        now = int(time.time())
        return json_response(ModelList(data=[Model(id=name, created=now) for name in await models.names()]))

    @service.route("GET", "/v1/models/{model:.+}", internal=False, media=OPENAI)
    @public
    async def get_model(request: web.Request) -> web.Response:
        """One model, or 404 `model_not_found`."""
        name = request.match_info["model"]
        if name not in await models.names():
            raise OpenAIError(404, f"the model `{name}` does not exist or no engine serves it", param="model",
                              code="model_not_found")
        return json_response(Model(id=name, created=int(time.time())))

    return service


def _prepared(request: web.Request, body, tokenizer: ModelTokenizer, ids: list[int], max_tokens: int, sampling,
              prompt_param: str, defaults: dict[str, SloClass], prompt_text: str | None = None) -> Prepared:
    """The context check and the request's SLOs; the request is ready to run."""
    limit, wanted = tokenizer.max_model_len, max(max_tokens, 1)
    if max_tokens < 1 and len(ids) < limit:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if len(ids) + wanted > limit:
        raise bad_request(f"this model's maximum context length is {limit} tokens; however, you requested "
                          f"{len(ids) + wanted} tokens ({len(ids)} in the {prompt_param}, {wanted} for the "
                          f"completion); reduce the {prompt_param} or max_tokens",
                          param=prompt_param, code="context_length_exceeded")
    slo = slo_of(body, request.headers, defaults)
    prefix = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
    generation = Generation(request_id=f"{prefix}-{uuid.uuid4().hex}", model=body.model, prompt_ids=list(ids),
                            max_tokens=max_tokens, sampling=sampling,
                            targets=Targets(ttft_slo_ms=slo.ttft_ms, tbt_slo_ms=slo.tbt_ms))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(generation, tokenizer, bool(body.stream), include_usage, slo, prompt_text)


def _conversation_text(messages: list[dict[str, str]]) -> str | None:
    """A conversation's text for the length predictor: its messages' contents, one after another, without
    the chat template's markup (a one-message chat reads as a completion of the same prompt); None when
    every message is empty."""
    return "\n".join(m["content"] for m in messages if m["content"]) or None


def _request_attributes(prepared: Prepared) -> dict:
    generation = prepared.generation
    return {"kvmesh.request_id": generation.request_id, "kvmesh.model": generation.model,
            "kvmesh.slo_class": prepared.slo.slo_class, "kvmesh.stream": prepared.stream,
            "kvmesh.prompt_tokens": len(generation.prompt_ids)}


def _outcome(reply: Answer, timing: Timing) -> dict:
    """The admission span's account of how the request went, as the client saw it."""
    ms = lambda seconds: None if seconds is None else seconds * 1e3  # noqa: E731
    return {"kvmesh.completion_tokens": len(timing.token_times), "kvmesh.cached_tokens": reply.cached_tokens,
            "kvmesh.finish_reason": reply.finish_reason, "kvmesh.ttft_ms": ms(timing.ttft_s),
            "kvmesh.tbt_ms": [gap * 1e3 for gap in timing.gaps_s], "kvmesh.e2e_ms": ms(timing.e2e_s)}


def _answer(prepared: Prepared) -> Answer:
    generation = prepared.generation
    return Answer(id=generation.request_id, created=int(time.time()), model=generation.model,
                  prompt_tokens=len(generation.prompt_ids), tokenizer=prepared.tokenizer,
                  logprobs=generation.sampling.logprobs)


async def _while_connected(request: web.Request, work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    """Run `work` until it ends or the client goes away; then cancel it, which aborts the request on
    every engine holding it (aiohttp does not cancel a handler when its client disconnects)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    log.info("%s %s: the client went away; request aborted", request.method, request.path)
    tracing.fail_current("the client went away; request aborted", abort=True)
    return web.Response(status=499)
