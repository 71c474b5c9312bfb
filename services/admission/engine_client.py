"""Admission's side of the engine API (docs/serving.md): the wire shapes it reads and sends, and the
calls: generate (colocated, prefill with `kv_transfer`, decode with `kv_source`), abort, tokenizer.

Services meet only over HTTP, so these structs mirror the engine's bodies instead of importing them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from msgspec import Struct

from kvmesh.libs.controlplane import KvmeshError, ServiceClient

log = logging.getLogger(__name__)

KVHandle = dict[str, Any]  # passed from the prefill engine's last frame to the decode engine untouched


class EngineRef(Struct, kw_only=True, frozen=True):
    """An engine as the scheduler names it."""

    id: str
    control_url: str
    data_address: str = ""
    role: str = "both"


class EngineUsage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class EngineTimings(Struct, kw_only=True):
    """Where a request's time went on one engine (unix seconds), on its last frame."""

    arrival: float
    scheduled: float | None = None
    pull_start: float | None = None
    pull_end: float | None = None
    first_token: float | None = None
    finished: float | None = None


class EngineFrame(Struct, kw_only=True):
    """One streamed frame of an engine's `POST /v1/generate`, `/v1/prefill` or `/v1/decode`: the new tokens of a request."""

    token_ids: list[int]
    text: str = ""
    times: list[float] = []
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    usage: EngineUsage | None = None
    kv_handle: KVHandle | None = None
    timings: EngineTimings | None = None


class GenerateBody(Struct, kw_only=True, omit_defaults=True):
    """An engine's `POST /v1/generate` (or `/v1/prefill` with kv_transfer, `/v1/decode` with
    kv_source) as admission sends it: always token ids, never text."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: bool = False
    kv_transfer: dict[str, Any] | None = None
    kv_source: KVHandle | None = None
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    predicted_output_len: int | None = None
    predicted_output_low: int | None = None     # the predicted range's lower bound and median (LayerKV)
    predicted_output_median: int | None = None


class TokenizerSpec(Struct, kw_only=True):
    """`GET /v1/tokenizer`."""

    model: str
    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, str]
    eos_token_ids: list[int]
    max_model_len: int


class EngineClients:
    """One pooled ServiceClient per engine control URL, with the cluster token."""

    def __init__(self, token: str | None, connect_timeout_s: float, abort_timeout_s: float):
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self._clients: dict[str, ServiceClient] = {}
        self._aborts: set[asyncio.Task] = set()

    def client(self, engine: EngineRef) -> ServiceClient:
        url = engine.control_url
        if url not in self._clients:
            self._clients[url] = ServiceClient(url, token=self.token, timeout=self.connect_timeout_s, retries=1)
        return self._clients[url]

    def generate(self, engine: EngineRef, body: GenerateBody, headers: dict[str, str] | None = None
                 ) -> AsyncIterator[EngineFrame]:
        """The request's frames; raises RemoteError (an error answer) or ServiceUnreachable (none)."""
        path = "/v1/prefill" if body.kv_transfer is not None else "/v1/decode" if body.kv_source is not None \
            else "/v1/generate"
        return self.client(engine).frames(path, body, EngineFrame, headers)

    async def reserve(self, engine: EngineRef, request_id: str, num_tokens: int, timeout: float) -> KVHandle:
        """Push mode: blocks on a decode engine for the prompt's KV (waits until its policy gives them)."""
        return await self.client(engine).call("POST", "/v1/kv/reserve", {"request_id": request_id,
                                                                         "num_tokens": num_tokens},
                                              into=dict, timeout=timeout)

    async def tokenizer(self, engine: EngineRef) -> TokenizerSpec:
        return await self.client(engine).call("GET", "/v1/tokenizer", into=TokenizerSpec)

    def abort(self, engine: EngineRef, request_id: str) -> None:
        """Ask the engine to stop the request and free its KV, in the background: callers are often
        being cancelled themselves, and an abort must not be lost with them."""
        task = asyncio.create_task(self._abort(engine, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, engine: EngineRef, request_id: str) -> None:
        try:
            await self.client(engine).call("POST", "/v1/abort", {"request_id": request_id}, idempotent=True,
                                           timeout=self.abort_timeout_s)
        except KvmeshError as exc:
            log.warning("abort of %s on %s failed: %s", request_id, engine.id, exc)

    async def close(self) -> None:
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self._clients.values()))
