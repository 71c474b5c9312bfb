"""Admission's public routes, OpenAI's: completions and chat completions, and the models served.

Per request, in order: API key (401), the key's rate limit (429 + Retry-After), the body (400), the
model (404), tokenization with the model's own tokenizer and the context limit (400), the wait it can
expect for its first token against its TTFT SLO or `max_wait_s` (429 + Retry-After), a place in the
bounded queue (429 + Retry-After), then the journey through the cluster (lifecycle.py). Every error
is OpenAI's shape (openai_api.py); a client that goes away aborts the request on every engine that
holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvmesh.libs.controlplane import read_body
from kvmesh.libs.messages.engine import Targets
from kvmesh.libs.messages.predictor import PredictedLength
from kvmesh.observability import logs, tracing
from kvmesh.policies.admission import behind_by

from .config import Config
from .engine_client import EngineClients
from .lifecycle import Generation, Lifecycle
from .limits import Backlog, BoundedQueue, QueueFull, RateLimiter
from .openai_api import (ChatCompletionRequest, CompletionRequest, Model, ModelList, OpenAIError, bad_request,
                         chat_checks, completion_checks, decode_body, messages_of, prompt_of, sampling_of)
from .predictor_client import with_predicted_lengths
from .responses import Answer, json_response, stream, whole
from .slo import Slo, SloClass, SloMetrics, Timing, slo_defaults, slo_of
from .tokenizers import Models, ModelTokenizer
from .upstreams import Upstreams

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1  # how soon a client that went away is noticed while nothing is written to it


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check: what to generate and how to answer."""

    generation: Generation
    tokenizer: ModelTokenizer
    stream: bool
    include_usage: bool
    slo: Slo
    prompt_text: str | None = None  # for the length predictor: the prompt as text, when it came as text


def public(handler: Callable[[OpenAIRoutes, web.Request], Awaitable[web.StreamResponse]]):
    """Key and rate limit first; every error in OpenAI's shape, never kvmesh's, never a bare 500."""
    @functools.wraps(handler)
    async def endpoint(self: OpenAIRoutes, request: web.Request) -> web.StreamResponse:
        try:
            key = self.authenticate(request)
            wait = self.limiter.take(key, time.monotonic())
            if wait:
                raise OpenAIError(429, f"rate limit reached for this API key ({self.config.requests_per_s:g} "
                                       f"requests/s, burst {self.config.burst:g})", type="requests",
                                  code="rate_limit_exceeded", retry_after_s=wait)
            return await handler(self, request)
        except OpenAIError as exc:
            if exc.status >= 500:
                tracing.fail_current(str(exc))
            return exc.response()
        except web.HTTPException as exc:  # aiohttp's own, e.g. a body over max_body_bytes
            return OpenAIError(exc.status, exc.text or exc.reason).response()
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return OpenAIError(500, "internal error in admission; see its log", type="server_error").response()
    return endpoint


class OpenAIRoutes:
    """The public routes (one method each) and what they share: the API keys and their rate limit,
    admission's queue and backlog, the models served, and each request's journey (lifecycle.py)."""

    def __init__(self, config: Config, upstreams: Upstreams, engines: EngineClients, models: Models,
                 metrics: CollectorRegistry):
        self.config = config
        self.keys = config.keys()
        if not self.keys:
            log.warning("no API key is configured (KVMESH_API_KEY, api_keys, api_key_file): every request is refused")
        self.limiter = RateLimiter(config.requests_per_s, config.burst)
        self.queue = BoundedQueue(config.max_running, config.max_queued)
        self.backlog = Backlog()
        self.upstreams = upstreams
        self.models = models
        self.lifecycle = Lifecycle(upstreams, engines, config.max_retries, config.stall_timeout_s,
                                   config.transfer_mode, config.scheduler_wait_s)
        self.slo_metrics = SloMetrics(metrics, self.queue)
        self.defaults = slo_defaults(config.slo_classes, config.default_ttft_ms, config.default_tbt_ms)

    @public
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI completions: a prompt (text or token ids) in, text out; SSE when `stream`."""
        body = decode_body(await read_body(request, self.config.body_timeout_s), CompletionRequest)
        return await self.answer(request, await self.prepare_completion(request, body), chat=False)

    @public
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI chat completions: messages through the model's chat template; SSE when `stream`."""
        body = decode_body(await read_body(request, self.config.body_timeout_s), ChatCompletionRequest)
        return await self.answer(request, await self.prepare_chat(request, body), chat=True)

    @public
    async def list_models(self, request: web.Request) -> web.Response:
        """The models some live engine serves."""
        now = int(time.time())
        return json_response(ModelList(data=[Model(id=name, created=now) for name in await self.models.names()]))

    @public
    async def get_model(self, request: web.Request) -> web.Response:
        """One model, or 404 `model_not_found`."""
        name = request.match_info["model"]
        if name not in await self.models.names():
            raise OpenAIError(404, f"the model `{name}` does not exist or no engine serves it", param="model",
                              code="model_not_found")
        return json_response(Model(id=name, created=int(time.time())))

    def authenticate(self, request: web.Request) -> str:
        if not self.keys:
            raise OpenAIError(401, "admission has no API key configured: set KVMESH_API_KEY, api_keys or "
                                   "api_key_file", code="invalid_api_key")
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise OpenAIError(401, "you didn't provide an API key: send it as `Authorization: Bearer <key>`",
                              code="invalid_api_key")
        matches = [hmac.compare_digest(presented.encode(), key.encode()) for key in self.keys]
        if not any(matches):
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        return presented

    def refuse_if_behind(self, slo: Slo) -> None:
        """A 429 for a request that can expect to wait longer than its TTFT SLO (else max_wait_s) for the
        requests ahead of it to get their first tokens: under overload a queue as long as admission's
        would otherwise hold every request taken for minutes, and the ones after the load for as long."""
        wait = self.backlog.expected_wait_s(time.monotonic())
        over = behind_by(wait, slo.ttft_ms, self.config.max_wait_s)
        if over is not None:
            raise OpenAIError(429, f"the cluster is behind: a request now can expect to wait {wait:.1f} s for the "
                                   f"{self.backlog.pending} ahead of it to start answering, over its limit of "
                                   f"{wait - over:g} s", type="requests", code="queue_full", retry_after_s=over)

    async def prepare_completion(self, request: web.Request, body: CompletionRequest) -> Prepared:
        completion_checks(body)
        sampling = sampling_of(body, logprobs=body.logprobs is not None)
        prompt = prompt_of(body)
        tokenizer = await self.models.tokenizer(body.model)
        ids = await asyncio.to_thread(tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return _prepared(request, body, tokenizer, ids, max_tokens, sampling, "prompt", self.defaults,
                         prompt_text=prompt if isinstance(prompt, str) else None)

    async def prepare_chat(self, request: web.Request, body: ChatCompletionRequest) -> Prepared:
        chat_checks(body)
        sampling = sampling_of(body, logprobs=bool(body.logprobs))
        messages = messages_of(body)
        tokenizer = await self.models.tokenizer(body.model)
        try:
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages)
        except Exception as exc:  # the model's template may refuse a conversation (say, roles out of order)
            raise bad_request(f"the model's chat template refused the messages: {exc}", param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = tokenizer.max_model_len - len(ids) if requested is None else requested
        return _prepared(request, body, tokenizer, ids, max_tokens, sampling, "messages", self.defaults,
                         prompt_text=_conversation_text(messages))

    async def answer(self, request: web.Request, prepared: Prepared, chat: bool) -> web.StreamResponse:
        """Hold a place in the queue while the request runs; the client going away cancels it."""
        timing = Timing(time.monotonic())  # the client's clock starts before admission's own queue

        async def respond(generation: Generation, prediction: PredictedLength | None) -> web.StreamResponse:
            """The request's journey through the cluster, once it holds a running slot."""
            reply = _answer(prepared)
            try:
                if prepared.stream:
                    async with contextlib.aclosing(self.lifecycle.run(generation)) as pieces:
                        response = await stream(request, pieces, reply, chat, prepared.include_usage, timing,
                                                self.config.client_write_timeout_s)
                else:
                    response = await whole(lambda run: self.lifecycle.run(generation, run), reply, chat, timing,
                                           self.config.max_retries)
            except OpenAIError:  # answered with an error status: a finished request all the same
                self.slo_metrics.record(prepared.slo, timing, reply.served, "error")
                raise
            finally:
                if tracing.enabled():
                    tracing.annotate(_outcome(reply, timing))
            self.slo_metrics.record(prepared.slo, timing, reply.served, reply.finish_reason)
            # the actual length goes to the predictor in force now, which may not be the one
            # that predicted it if the predictor was swapped meanwhile (each learns from any)
            if prediction is not None and reply.finish_reason in ("stop", "length") \
                    and self.upstreams.predictor is not None:
                self.upstreams.predictor.observe(generation.model, len(generation.prompt_ids),
                                                 len(timing.token_times), prediction, prepared.prompt_text)
            return response

        async def run() -> web.StreamResponse:
            self.refuse_if_behind(prepared.slo)
            # counted in the backlog from its check on, with no await between: requests checked
            # together (a burst, each still asking the predictor) see each other
            with self.backlog.waiting(time.monotonic) as first_token:
                timing.on_first_token = first_token
                generation, prediction = prepared.generation, None
                # before the queue: the predictor's arrival rate is the arrivals'
                if self.upstreams.predictor is not None:
                    prediction = await self.upstreams.predictor.predict(generation.prompt_ids, generation.max_tokens,
                                                                        generation.model, prepared.prompt_text)
                    if prediction is not None:
                        generation = dataclasses.replace(generation, targets=with_predicted_lengths(
                            generation.targets, prediction, generation.max_tokens))
                try:
                    async with self.queue.slot():
                        return await respond(generation, prediction)
                except QueueFull as exc:
                    raise OpenAIError(429, str(exc), type="requests", code="queue_full",
                                      retry_after_s=self.config.queue_retry_after_s) from None

        if tracing.enabled():
            tracing.annotate(_request_attributes(prepared))
        with logs.request_context(prepared.generation.request_id):  # the run task copies it
            return await _while_connected(request, run())


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
