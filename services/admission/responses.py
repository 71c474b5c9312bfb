"""OpenAI response objects from the pieces a request's journey yields, and their delivery: the whole
answer as JSON, or one server-sent event per piece (completions and chat), then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from kvmesh.observability import tracing

from .lifecycle import AfterFirstToken, Piece
from .openai_api import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChoiceLogprobs,
                         ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, Delta, KvmeshInfo,
                         OpenAIError, PromptTokensDetails, TokenLogprob, Usage)
from .slo import Timing
from .tokenizers import ModelTokenizer

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse(value: Any) -> bytes:
    return b"data: " + msgspec.json.encode(value) + b"\n\n"


def json_response(value: Any, request_id: str | None = None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.Response(body=msgspec.json.encode(value), content_type="application/json", headers=headers)


@dataclass
class Answer:
    """The request's identity, and everything sent so far."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    tokenizer: ModelTokenizer
    logprobs: bool
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    served: KvmeshInfo | None = None

    def restart(self) -> None:
        """Forget what was collected: the request runs again from the start."""
        self.text, self.token_ids, self.token_logprobs = "", [], []
        self.finish_reason, self.cached_tokens, self.served = None, 0, None

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.token_ids += piece.token_ids
        self.token_logprobs += piece.logprobs or []
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.cached_tokens = max(self.cached_tokens, piece.cached_tokens)
        self.served = piece.served or self.served

    def usage(self) -> Usage:
        completion = len(self.token_ids)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    # -- completions ------------------------------------------------------------------------------

    def completion(self) -> Completion:
        choice = CompletionChoice(text=self.text, finish_reason=self.finish_reason,
                                  logprobs=self._completion_logprobs(self.token_ids, self.token_logprobs, 0))
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage(),
                          kvmesh=self.served)

    def completion_chunk(self, piece: Piece, offset: int) -> Completion:
        """`offset`: characters of text sent before this piece."""
        choice = CompletionChoice(text=piece.text, finish_reason=piece.finish_reason,
                                  logprobs=self._completion_logprobs(piece.token_ids, piece.logprobs or [], offset))
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice], kvmesh=piece.served)

    def completion_usage_chunk(self) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())

    def _completion_logprobs(self, ids: list[int], logprobs: list[float], offset: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        tokens = [self.tokenizer.token_text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets)

    # -- chat -------------------------------------------------------------------------------------

    def chat_completion(self) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=self.text), finish_reason=self.finish_reason or "stop",
                            logprobs=self._chat_logprobs(self.token_ids, self.token_logprobs))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage(),
                              kvmesh=self.served)

    def chat_chunk(self, piece: Piece, first: bool) -> ChatCompletionChunk:
        delta = Delta(role="assistant" if first else None, content=piece.text)
        choice = ChunkChoice(delta=delta, finish_reason=piece.finish_reason,
                             logprobs=self._chat_logprobs(piece.token_ids, piece.logprobs or []))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                   kvmesh=piece.served)

    def chat_usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())

    def _chat_logprobs(self, ids: list[int], logprobs: list[float]) -> ChoiceLogprobs | None:
        if not self.logprobs:
            return None
        content = []
        for token_id, logprob in zip(ids, logprobs):
            text = self.tokenizer.token_text(token_id)
            content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode())))
        return ChoiceLogprobs(content=content)


async def whole(journey: Callable[[int], AsyncIterator[Piece]], answer: Answer, chat: bool, timing: Timing,
                retries: int) -> web.Response:
    """Collect every piece of `journey(run)`, then answer once. The client has seen nothing until then,
    so an engine failing midway costs only time: the request runs again from the start, up to
    `retries` times, and only then is a 503."""
    for attempt in range(retries + 1):
        answer.restart()
        timing.restart()
        try:
            async with contextlib.aclosing(journey(attempt)) as pieces:
                async for piece in pieces:
                    timing.tokens(time.monotonic(), len(piece.token_ids))
                    answer.add(piece)
            return json_response(answer.chat_completion() if chat else answer.completion(), answer.id)
        except AfterFirstToken as exc:
            failure = exc
            log.warning("%s after %d tokens of an answer not yet sent (run %d of %d)",
                        exc, len(answer.token_ids), attempt + 1, retries + 1)
    raise OpenAIError(503, str(failure), type="server_error", code="engine_failed")


async def stream(request: web.Request, pieces: AsyncIterator[Piece], answer: Answer, chat: bool,
                 include_usage: bool, timing: Timing, write_timeout_s: float) -> web.StreamResponse:
    """One event per piece, sent as it comes. The response starts only with the first piece, so an
    error before it still gets its own status; an engine failing after it ends the stream with an
    error event. A client that takes nothing for `write_timeout_s` (it stopped reading) is gone."""
    first = await anext(pieces)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": answer.id})
    await response.prepare(request)

    async def send(data: bytes) -> None:
        async with asyncio.timeout(write_timeout_s):
            await response.write(data)

    try:
        piece: Piece | None = first
        while piece is not None:
            timing.tokens(time.monotonic(), len(piece.token_ids))
            offset = len(answer.text)
            answer.add(piece)
            chunk = answer.chat_chunk(piece, first=piece is first) if chat else answer.completion_chunk(piece, offset)
            await send(sse(chunk))
            piece = await anext(pieces, None)
        if include_usage:
            await send(sse(answer.chat_usage_chunk() if chat else answer.completion_usage_chunk()))
        await send(DONE)
    except AfterFirstToken as exc:
        tracing.fail_current(exc)
        await send(sse(OpenAIError(503, str(exc), type="server_error", code="engine_failed").body()) + DONE)
    except ConnectionResetError:  # the client went away: the caller closing `pieces` aborts the request
        log.info("the client went away mid-stream after %d tokens; request aborted", len(timing.token_times))
        tracing.fail_current("the client went away mid-stream", abort=True)
    except TimeoutError:  # it stopped reading: closed, and the caller closing `pieces` aborts the request
        log.info("the client took nothing for %g s after %d tokens; request aborted", write_timeout_s,
                 len(timing.token_times))
        tracing.fail_current("the client stopped reading mid-stream", abort=True)
        if request.transport is not None:
            request.transport.abort()
    except Exception as exc:  # a bug: the stream has started, so it must still end (an error event), not hang
        log.exception("stream of %s failed after %d tokens", answer.id, len(timing.token_times))
        tracing.fail_current(str(exc))
        await send(sse(OpenAIError(500, "internal error in admission; see its log", type="server_error").body()) + DONE)
    return response
