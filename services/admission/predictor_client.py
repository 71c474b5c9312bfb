"""Admission's calls to the predictor service (CacheOpt): the output length to allocate for before
a request runs, and its actual length after. A prediction only helps the engines plan, so a
predictor that fails or is slow never fails a request: the request runs without one.

The prompt goes as text when the request had text (what the `embedding` predictor reads), else as
token ids, cut to the predictor's limits rather than refused with a 400."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from opentelemetry.trace import SpanKind

from kvmesh.libs.controlplane import KvmeshError, ServiceClient
from kvmesh.libs.messages.engine import Targets
from kvmesh.libs.messages.predictor import (MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS, ObserveRequest, PredictedLength,
                                            PredictRequest)
from kvmesh.observability import tracing
from kvmesh.policies.length.padding import predicted_range

log = logging.getLogger(__name__)


def with_predicted_lengths(targets: Targets, prediction: PredictedLength, max_tokens: int) -> Targets:
    """`targets` with what the engines' policies are told of a request's output length: the padded
    estimate to allocate for (CacheOpt), and the range predicted +- padding as its lower bound and
    median (LayerKV reads the lower bound for the tokens still to come, the median for when it ends)."""
    low, median = predicted_range(prediction.predicted, prediction.padding, max_tokens)
    return msgspec.structs.replace(targets, predicted_output_len=prediction.estimated, predicted_output_low=low,
                                   predicted_output_median=median)


class PredictorClient:
    def __init__(self, url: str, token: str | None, timeout_s: float):
        self._client = ServiceClient(url, token=token, timeout=timeout_s, retries=0)
        self._observing: set[asyncio.Task] = set()

    async def predict(self, prompt_ids: list[int], max_tokens: int, tenant: str,
                      text: str | None = None) -> PredictedLength | None:
        """The request's predicted length; its prompt as `text` when it had text, else as its ids."""
        prompt = {"prompt": text[:MAX_PROMPT_CHARS]} if text else {"prompt_token_ids": prompt_ids[:MAX_PROMPT_TOKENS]}
        with tracing.span("predict", kind=SpanKind.CLIENT) as span:
            try:
                body = PredictRequest(max_tokens=max_tokens, tenant=tenant, **prompt)
                answer = await self._client.call("POST", "/v1/predict", body, into=PredictedLength)
            except (KvmeshError, ValueError) as exc:  # ValueError: a prompt the predictor would refuse
                log.warning("no length prediction (the request runs without one): %s", exc)
                tracing.failed(span, exc)
                return None
            tracing.annotate({"kvmesh.predicted": answer.predicted, "kvmesh.estimated": answer.estimated,
                              "kvmesh.padding": answer.padding, "kvmesh.confidence": answer.confidence})
            return answer

    @property
    def longest_call_s(self) -> float:
        return self._client.longest_call_s

    def observe(self, tenant: str, prompt_len: int, actual: int, prediction: PredictedLength,
                text: str | None = None) -> None:
        """The request's actual output length, in the background (the answer has gone already), with
        its prompt text when it had one (what `embedding` learns from)."""
        body = ObserveRequest(tenant=tenant, prompt_len=prompt_len, actual=actual, predicted=prediction.predicted,
                              estimated=prediction.estimated, prompt=text[:MAX_PROMPT_CHARS] if text else None)
        task = asyncio.create_task(self._observe(body))
        self._observing.add(task)
        task.add_done_callback(self._observing.discard)

    async def _observe(self, body: ObserveRequest) -> None:
        try:
            await self._client.call("POST", "/v1/observe", body)
        except KvmeshError as exc:
            log.warning("the predictor did not take an observed length: %s", exc)

    async def close(self) -> None:
        if self._observing:
            await asyncio.gather(*self._observing, return_exceptions=True)
        await self._client.close()
