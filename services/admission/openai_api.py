"""The public API's bodies, as the OpenAI API and its official Python client shape them, and its errors.

Requests: `CompletionRequest` (`POST /v1/completions`) and `ChatCompletionRequest`
(`POST /v1/chat/completions`). Unknown fields are ignored, as vLLM does; fields kvmesh cannot honour
(n > 1, echo, suffix, penalties, logit_bias, tools, a non-text response_format) are a 400 that says
so, never silently dropped. kvmesh's own extensions, which the official client sends through
`extra_body`: `slo_class` (one of admission's `slo_classes`), `ttft_ms` and `tbt_ms` (per-request SLOs),
`top_k` and `ignore_eos`. The ranges a field accepts are on its struct, so the published description
(docs/api/admission.openapi.json) states the bounds the front door holds to.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, not kvmesh's internal one:

| status | type | code |
| --- | --- | --- |
| 400 | invalid_request_error | None, `invalid_json`, `context_length_exceeded`, `unsupported_parameter` |
| 401 | invalid_request_error | `invalid_api_key` |
| 404 | invalid_request_error | `model_not_found`, `not_found` |
| 429 | requests | `rate_limit_exceeded` (per key), `queue_full` (admission is full, or a request would wait past its TTFT SLO or `max_wait_s` behind those ahead); with Retry-After |
| 503 | server_error | `no_engine`, `engine_failed` |
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from msgspec import Meta, Struct


class OpenAIError(Exception):
    """An error the front door answers in OpenAI's shape, with its status and headers."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()), headers=headers,
                            content_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# -- requests -------------------------------------------------------------------------------------


NonEmpty = Annotated[str, Meta(min_length=1)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """What both endpoints share."""

    model: str
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Meta(max_length=16)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1)] | None = 1  # 1 only: more is an unsupported_parameter
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # kvmesh extensions (the official client sends them through `extra_body`)
    slo_class: str | None = None
    ttft_ms: Annotated[float, Meta(gt=0.0)] | None = None
    tbt_ms: Annotated[float, Meta(gt=0.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None  # 0: off
    ignore_eos: bool | None = False


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]             # text, token ids, or a batch of one of either
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class Sampling(Struct, kw_only=True, frozen=True):
    """The checked sampling parameters, in the engine's vocabulary (max_tokens resolved later)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    logprobs: bool


_AT = re.compile(r"at `\$\.([A-Za-z_]+)")


def decode_body(raw: bytes, into: type[Struct]) -> Any:
    """The request body as `into`, or a 400 that names the field (never a 500 for bad input)."""
    try:
        return msgspec.json.decode(raw, type=into)
    except msgspec.ValidationError as exc:
        where = _AT.search(str(exc))
        message = str(exc)
        if "Object missing required field" in message:
            field = message.split("`")[1] if "`" in message else None
            raise bad_request(f"you must provide the `{field}` parameter", param=field) from None
        raise bad_request(f"invalid request body: {message}", param=where.group(1) if where else None) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"we could not parse the JSON body of your request: {exc}", code="invalid_json") from None


def sampling_of(body: SamplingFields, logprobs: bool) -> Sampling:
    """Check the shared fields against what OpenAI allows and kvmesh serves."""
    if body.n not in (None, 1):
        raise bad_request("only n=1 is supported", param="n", code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise bad_request(f"`{name}` is not supported", param=name, code="unsupported_parameter")
    if body.logit_bias:
        raise bad_request("`logit_bias` is not supported", param="logit_bias", code="unsupported_parameter")
    # the ranges are the structs' (decode_body checked them): what is left is to resolve the defaults
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
                    stop=stop, ignore_eos=bool(body.ignore_eos), logprobs=logprobs)


def completion_checks(body: CompletionRequest) -> None:
    """The completions-only fields kvmesh does not serve."""
    if body.echo:
        raise bad_request("`echo` is not supported", param="echo", code="unsupported_parameter")
    if body.suffix:
        raise bad_request("`suffix` is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", param="best_of", code="unsupported_parameter")


def chat_checks(body: ChatCompletionRequest) -> None:
    """The chat-only fields kvmesh does not serve."""
    if body.tools or body.tool_choice not in (None, "none"):
        raise bad_request("tools are not supported", param="tools", code="unsupported_parameter")
    if body.response_format and body.response_format.get("type") != "text":
        raise bad_request("only the `text` response_format is supported", param="response_format",
                          code="unsupported_parameter")
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported (the chosen token's logprob is)", param="top_logprobs",
                          code="unsupported_parameter")


def prompt_of(body: CompletionRequest) -> str | list[int]:
    """One prompt, text or token ids; a batch of more than one is a 400."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("batches of prompts are not supported: send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list) and not all(type(t) is int and 0 <= t < 2**31 for t in prompt):
        raise bad_request("`prompt` must be a string, a list of token ids (0 <= id < 2**31), or a list of one "
                          "of either", param="prompt")
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    return prompt


def messages_of(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The conversation as the chat template reads it: role and text content."""
    messages = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", param=f"messages[{i}].content")
            content = "".join(part.text for part in content)
        messages.append({"role": message.role, "content": content or ""})
    return messages


# -- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class KvmeshInfo(Struct, kw_only=True):
    """kvmesh's own addition to the last chunk or the whole answer (OpenAI clients ignore it): how the
    request was served and where its time went, in ms (prefill_queue, prefill, decode_queue,
    transfer, decode)."""

    mode: str                                 # "disaggregated" or "colocated"
    transfer_mode: str | None = None          # "pull" or "push" when disaggregated
    timings_ms: dict[str, float] | None = None


class Completion(Struct, kw_only=True):
    """`text_completion`, the whole answer or one streamed chunk of it (then `usage` only on the last)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvmesh: KvmeshInfo | None = None


class TokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = []


class ChoiceLogprobs(Struct, kw_only=True):
    content: list[TokenLogprob]


class AssistantMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvmesh: KvmeshInfo | None = None


class Delta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    kvmesh: KvmeshInfo | None = None


class Model(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "kvmesh"


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[Model]
