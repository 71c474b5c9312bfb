"""A request's journey through the cluster, after admission has let it in and tokenized it.

    route -> colocated:      one engine's /v1/generate, relayed
          -> disaggregated:  prefill engine's /v1/prefill (max_tokens 1, kv_transfer pull) -> first token
                             to the client at once -> decode engine's /v1/decode (prompt + first
                             token, kv_source = the handle) relayed

An engine that fails before the first token reached the client (no answer, a 5xx, a stream that
stops without finishing, no frame within `stall_timeout_s`) is excluded and the request routed
again, up to `max_retries` times; after the first token, a failure ends the request with an error.
Whatever way the journey ends early (a failure, the client going away, cancellation), every engine
still holding the request is sent `POST /v1/abort`, so its blocks, and a prefill's held KV, are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec
from opentelemetry.trace import SpanKind

from kvmesh.libs.controlplane import KvmeshError, RemoteError, ServiceUnreachable
from kvmesh.libs.messages.engine import Frame, GenerateRequest, KVHandle, KVTransfer, Targets, Timings
from kvmesh.libs.messages.scheduler import Route, WorkerRef
from kvmesh.observability import tracing

from .engine_client import EngineClients
from .openai_api import KvmeshInfo, OpenAIError, Sampling
from .upstreams import Upstreams

log = logging.getLogger(__name__)

SCHEDULER_RETRY_S = 0.25  # how often a scheduler that does not answer is asked again


@dataclass(frozen=True)
class Generation:
    """What to generate: a tokenized prompt and checked sampling parameters."""

    request_id: str
    model: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    targets: Targets = Targets()    # the request's SLOs and predicted output length, for the engines' policies

    def continued(self, tokens: list[int]) -> Generation:
        """What is left once `tokens` are generated: they join the prompt, and fewer are left to make."""
        return dataclasses.replace(self, prompt_ids=[*self.prompt_ids, *tokens],
                                   max_tokens=self.max_tokens - len(tokens),
                                   targets=_still_to_come(self.targets, len(tokens)))

    def body(self, request_id: str, **changes) -> GenerateRequest:
        s = self.sampling
        fields = dict(request_id=request_id, prompt_token_ids=self.prompt_ids, max_tokens=self.max_tokens,
                      temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed, stop=s.stop,
                      ignore_eos=s.ignore_eos, logprobs=s.logprobs, targets=self.targets)
        return GenerateRequest(**{**fields, **changes})


@dataclass
class Piece:
    """The next tokens for the client; the last piece has `finish_reason` ("stop" or "length")."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    served: KvmeshInfo | None = None      # on the last piece: how it was served, where the time went


class EngineFailed(Exception):
    def __init__(self, engine: WorkerRef, reason: str):
        super().__init__(f"engine {engine.id} failed: {reason}")
        self.engine = engine


class AfterFirstToken(Exception):
    """An engine failed after the client had tokens: the request ends with this error."""


@dataclass
class Journey:
    """One request's path; `holding` maps each engine that may still hold it to the request id there.
    `generation` is what is left to generate: after a migration, the prompt with the tokens sent."""

    generation: Generation
    holding: dict[str, tuple[WorkerRef, str]] = field(default_factory=dict)
    sent: list[int] = field(default_factory=list)  # token ids the client has

    def migrate(self) -> None:
        """Continue on another engine: the tokens sent join the prompt, and fewer are left to make."""
        self.generation = self.generation.continued(self.sent)
        self.sent = []


class Lifecycle:
    def __init__(self, upstreams: Upstreams, engines: EngineClients, max_retries: int, stall_timeout_s: float,
                 transfer_mode: str = "pull", scheduler_wait_s: float = 0.0):
        self.upstreams = upstreams  # the scheduler in force at each call: it may be swapped between two
        self.engines = engines
        self.max_retries = max_retries
        self.stall_timeout_s = stall_timeout_s
        self.transfer_mode = transfer_mode
        self.scheduler_wait_s = scheduler_wait_s

    async def run(self, generation: Generation, rerun: int = 0) -> AsyncIterator[Piece]:
        """The request's pieces; raises OpenAIError before the first piece, AfterFirstToken when every
        try has failed after it. An engine that fails mid-answer is excluded and the request migrates:
        another engine gets the prompt with the tokens sent and makes the rest, so the client's stream
        goes on (as Dynamo migrates requests; a stop string across the seam is not seen). `rerun` counts
        earlier runs of the same request (an answer not yet sent, run again): its ids at the engines
        stay apart from theirs, which may still be held there until aborted."""
        journey = Journey(generation)
        excluded: list[str] = []
        try:
            for attempt in range(self.max_retries + 1):
                route = await self._route(journey.generation, excluded)
                tracing.annotate({"kvmesh.retries": attempt, "kvmesh.transfer_mode": (
                    "colocated" if route.mode == "colocated" else self.transfer_mode)})
                request_id = f"{generation.request_id}.{rerun * (self.max_retries + 1) + attempt}"
                steps = (self._colocated(journey, route.engine, request_id) if route.mode == "colocated"
                         else self._disaggregated(journey, route.prefill, route.decode, request_id))
                try:
                    async with contextlib.aclosing(steps):
                        async for piece in steps:
                            yield piece
                            journey.sent += piece.token_ids
                    return
                except EngineFailed as exc:
                    log.warning("%s after %d tokens (attempt %d); routing again without it", exc, len(journey.sent),
                                attempt + 1)
                    excluded.append(exc.engine.id)
                    self._abort_all(journey)
                    if journey.sent:
                        journey.migrate()
                        failure = exc
                        if journey.generation.max_tokens <= 0:  # every token sent, only the ending lost
                            yield Piece(token_ids=[], text="", finish_reason="length")
                            return
            if journey.generation is not generation:
                raise AfterFirstToken(str(failure))
            raise OpenAIError(503, f"every engine tried failed before the first token (tried: {', '.join(excluded)})",
                              type="server_error", code="engine_failed")
        finally:
            self._abort_all(journey)

    async def _route(self, generation: Generation, excluded: list[str]) -> Route:
        """The scheduler's route. A scheduler that does not answer is asked again for up to
        `scheduler_wait_s` (a supervisor restarts a dead one within seconds); asking twice is harmless,
        since a route only picks engines."""
        waited_until = time.monotonic() + self.scheduler_wait_s
        while True:
            try:
                with tracing.span("route", kind=SpanKind.CLIENT):
                    route = await self.upstreams.scheduler.route(generation.model, generation.prompt_ids, excluded)
                    tracing.annotate({"kvmesh.policy": route.policy, "kvmesh.mode": route.mode, **_engines(route)})
                tracing.annotate(_engines(route))  # on the request's span: where it ran in the end
                return route
            except RemoteError as exc:
                if exc.status == 400:
                    raise OpenAIError(400, f"the scheduler refused the request: {exc.message}") from None
                reason = exc.message
                break
            except ServiceUnreachable as exc:
                reason = exc.message
                if time.monotonic() >= waited_until:
                    break
                await asyncio.sleep(SCHEDULER_RETRY_S)
        raise OpenAIError(503, f"the scheduler could not route the request: {reason}", type="server_error",
                          code="no_engine")

    async def _colocated(self, journey: Journey, engine: WorkerRef, request_id: str) -> AsyncIterator[Piece]:
        journey.holding[engine.id] = (engine, request_id)
        async for frame in self._frames("generate", engine, journey.generation.body(request_id)):
            piece = _piece(frame)
            if frame.timings is not None:
                piece.served = KvmeshInfo(mode="colocated", timings_ms=breakdown(frame.timings, None))
            yield piece
        del journey.holding[engine.id]

    async def _disaggregated(self, journey: Journey, prefill: WorkerRef, decode: WorkerRef,
                             request_id: str) -> AsyncIterator[Piece]:
        generation = journey.generation
        push, reserve_ms = self.transfer_mode == "push", None
        transfer = KVTransfer(mode="pull")
        if push:  # the decode engine gives blocks first; the prefill engine writes into them
            journey.holding[decode.id] = (decode, request_id)
            started = time.monotonic()
            target = await self._reserve(decode, request_id, len(generation.prompt_ids))
            transfer = KVTransfer(mode="push", target=target)
            reserve_ms = (time.monotonic() - started) * 1e3
        journey.holding[prefill.id] = (prefill, request_id)
        frames = [f async for f in self._frames("prefill", prefill,
                                                 generation.body(request_id, max_tokens=1, kv_transfer=transfer))]
        if push:
            del journey.holding[prefill.id]  # written and freed: nothing is held there
        first, last = _merge(frames), frames[-1]
        done = last.finish_reason != "length" or generation.max_tokens <= len(first.token_ids)
        if not done and not push and last.kv_handle is None:
            raise EngineFailed(prefill, "the prefill's last frame carries no kv_handle")
        served = lambda decoded: KvmeshInfo(  # noqa: E731
            mode="disaggregated", transfer_mode=self.transfer_mode,
            timings_ms=breakdown(last.timings, decoded, reserve_ms) if last.timings else None)
        if done:
            first.served = served(None)
            yield first  # KV held (pull) or reserved (push) for a decode that will not come: aborted
            return
        first.finish_reason = None
        yield first
        body = generation.continued(first.token_ids).body(request_id,
                                                          kv_source=transfer.target if push else last.kv_handle)
        failed: list[str] = []
        while True:
            journey.holding[decode.id] = (decode, request_id)
            decoded = False
            try:
                async for frame in self._frames("decode", decode, body):
                    piece = _piece(frame)
                    if frame.timings is not None:
                        piece.served = served(frame.timings)
                    decoded = True
                    yield piece
                break
            except EngineFailed as exc:
                # Before its first token the decode engine can be swapped: the prefill engine still
                # holds the KV (until its lease runs out), so another decode engine can pull it.
                # Pushed KV sits in the failed decode engine's blocks: nothing to swap to.
                if decoded or push or len(failed) >= self.max_retries:
                    raise
                log.warning("%s before decoding; trying another decode engine", exc)
                self.engines.abort(decode, request_id)
                del journey.holding[decode.id]
                failed.append(decode.id)
                decode = await self._another_decode(generation, failed, exc)
        del journey.holding[decode.id]
        journey.holding.pop(prefill.id, None)  # pulled and COMPLETEd: the prefill freed it

    async def _reserve(self, decode: WorkerRef, request_id: str, num_tokens: int) -> KVHandle:
        with _engine_errors(decode), tracing.span("reserve", kind=SpanKind.CLIENT,
                                                  attributes={"kvmesh.engine": decode.id}):
            return await self.engines.reserve(decode, request_id, num_tokens, self.stall_timeout_s)

    async def _another_decode(self, generation: Generation, failed: list[str], failure: EngineFailed) -> WorkerRef:
        """Another decode engine to pull the held KV; with none left, the failure stands, and the
        request migrates (run) to whatever engine serves on: the prompt and first token computed again."""
        try:
            route = await self._route(generation, failed)
        except OpenAIError:
            raise failure from None
        if route.mode != "disaggregated" or route.decode is None:
            raise failure
        return route.decode

    async def _frames(self, step: str, engine: WorkerRef, body: GenerateRequest) -> AsyncIterator[Frame]:
        """The engine's frames up to the finishing one; any way the engine fails is EngineFailed. The
        call is the CLIENT span `step` (not made current: this generator yields to its consumer)."""
        span = tracing.start(step, kind=SpanKind.CLIENT,
                             attributes={"kvmesh.engine": engine.id, "kvmesh.request_id": body.request_id})
        stream = self.engines.generate(engine, body, tracing.headers(span))
        error: BaseException | None = None
        try:
            while True:
                try:
                    with _engine_errors(engine):
                        async with asyncio.timeout(self.stall_timeout_s):
                            frame = await anext(stream)
                except StopAsyncIteration:
                    raise EngineFailed(engine, "its stream ended before the request finished") from None
                except TimeoutError:
                    raise EngineFailed(engine, f"no frame within {self.stall_timeout_s:g}s") from None
                if frame.finish_reason in ("abort", "error"):
                    raise EngineFailed(engine, f"the request finished with `{frame.finish_reason}`")
                yield frame
                if frame.finish_reason is not None:
                    return
        except BaseException as exc:
            error = exc
            raise
        finally:
            tracing.finish(span, error)
            await stream.aclose()

    def _abort_all(self, journey: Journey) -> None:
        for engine, request_id in journey.holding.values():
            self.engines.abort(engine, request_id)
        journey.holding.clear()


def _still_to_come(targets: Targets, generated: int) -> Targets:
    """The targets with the predicted output lengths left after `generated` tokens (the prefill's first
    token, or those sent before a migration); each at least 1 (a request past its prediction is
    predicted to end soon)."""
    left = lambda predicted: None if predicted is None else max(1, predicted - generated)  # noqa: E731
    return msgspec.structs.replace(targets, predicted_output_len=left(targets.predicted_output_len),
                                   predicted_output_low=left(targets.predicted_output_low),
                                   predicted_output_median=left(targets.predicted_output_median))


def _engines(route: Route) -> dict[str, str | None]:
    if route.engine is not None:
        return {"kvmesh.prefill_engine": route.engine.id, "kvmesh.decode_engine": route.engine.id}
    return {"kvmesh.prefill_engine": route.prefill.id if route.prefill else None,
            "kvmesh.decode_engine": route.decode.id if route.decode else None}


@contextlib.contextmanager
def _engine_errors(engine: WorkerRef) -> Iterator[None]:
    """An engine's 400 is the client's error (OpenAI 400); any other failure is the engine's."""
    try:
        yield
    except RemoteError as exc:
        if exc.status == 400:
            raise OpenAIError(400, f"the engine {engine.id} refused the request: {exc.message}") from None
        raise EngineFailed(engine, str(exc)) from None
    except KvmeshError as exc:
        raise EngineFailed(engine, str(exc)) from None


def breakdown(first: Timings, decode: Timings | None, reserve_ms: float | None = None) -> dict[str, float]:
    """KVDirect Fig. 14's breakdown in ms, from the engines' timings: the engine that produced the
    first token (prefill, or the colocated one) and, when disaggregated, the decode engine. Decode
    queueing runs from the first token to the start of the KV transfer (the hop through admission
    and waiting for blocks). In push mode (`reserve_ms` given) the wait for the decode engine's
    blocks comes before prefill and counts as prefill queueing, and the writes overlap the
    prefill's layers, so no transfer time is left outside it. The engines' clocks are taken to
    agree (one host, or NTP)."""
    ms = lambda start, end: max(0.0, (end - start) * 1e3) if start is not None and end is not None else 0.0  # noqa: E731
    times = {"prefill_queue": (reserve_ms or 0.0) + ms(first.arrival, first.scheduled),
             "prefill": ms(first.scheduled, first.first_token)}
    if decode is not None and reserve_ms is not None:
        return {**times, "decode_queue": ms(first.first_token, decode.pull_end), "transfer": 0.0,
                "decode": ms(decode.pull_end, decode.finished)}
    if decode is None:
        return {**times, "decode_queue": 0.0, "transfer": 0.0, "decode": ms(first.first_token, first.finished)}
    return {**times, "decode_queue": ms(first.first_token, decode.pull_start),
            "transfer": ms(decode.pull_start, decode.pull_end), "decode": ms(decode.pull_end, decode.finished)}


def _piece(frame: Frame) -> Piece:
    return Piece(list(frame.token_ids), frame.text, frame.logprobs, frame.finish_reason,
                 frame.usage.cached_tokens if frame.usage else 0)


def _merge(frames: list[Frame]) -> Piece:
    """The prefill's frames (usually one) as one piece."""
    pieces = [_piece(f) for f in frames]
    logprobs = None if any(p.logprobs is None for p in pieces) else [lp for p in pieces for lp in p.logprobs]
    return Piece([t for p in pieces for t in p.token_ids], "".join(p.text for p in pieces), logprobs,
                 pieces[-1].finish_reason, pieces[-1].cached_tokens)
