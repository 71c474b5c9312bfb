"""Admission's side of the engine API (docs/serving.md): the wire shapes it reads and sends, and the
calls: generate (colocated, prefill with `kv_transfer`, decode with `kv_source`), abort, tokenizer.

The bodies are libs/messages/engine.py's, the ones the engine decodes and encodes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from kvmesh.libs.controlplane import KvmeshError, ServiceClient
from kvmesh.libs.messages.engine import AbortRequest, Frame, GenerateRequest, KVHandle, KVReserve, TokenizerSpec
from kvmesh.libs.messages.scheduler import WorkerRef

log = logging.getLogger(__name__)


class EngineClients:
    """One pooled ServiceClient per engine control URL, with the cluster token."""

    def __init__(self, token: str | None, connect_timeout_s: float, abort_timeout_s: float):
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self._clients: dict[str, ServiceClient] = {}
        self._aborts: set[asyncio.Task] = set()

    def client(self, engine: WorkerRef) -> ServiceClient:
        url = engine.control_url
        if url not in self._clients:
            self._clients[url] = ServiceClient(url, token=self.token, timeout=self.connect_timeout_s, retries=1)
        return self._clients[url]

    def generate(self, engine: WorkerRef, body: GenerateRequest, headers: dict[str, str] | None = None
                 ) -> AsyncIterator[Frame]:
        """The request's frames; raises RemoteError (an error answer) or ServiceUnreachable (none)."""
        path = "/v1/prefill" if body.kv_transfer is not None else "/v1/decode" if body.kv_source is not None \
            else "/v1/generate"
        return self.client(engine).frames(path, body, Frame, headers)

    async def reserve(self, engine: WorkerRef, request_id: str, num_tokens: int, timeout: float) -> KVHandle:
        """Push mode: blocks on a decode engine for the prompt's KV (waits until its policy gives them)."""
        return await self.client(engine).call("POST", "/v1/kv/reserve",
                                              KVReserve(request_id=request_id, num_tokens=num_tokens),
                                              into=KVHandle, timeout=timeout)

    async def tokenizer(self, engine: WorkerRef) -> TokenizerSpec:
        return await self.client(engine).call("GET", "/v1/tokenizer", into=TokenizerSpec)

    def abort(self, engine: WorkerRef, request_id: str) -> None:
        """Ask the engine to stop the request and free its KV, in the background: callers are often
        being cancelled themselves, and an abort must not be lost with them."""
        task = asyncio.create_task(self._abort(engine, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, engine: WorkerRef, request_id: str) -> None:
        try:
            await self.client(engine).call("POST", "/v1/abort", AbortRequest(request_id=request_id), idempotent=True,
                                           timeout=self.abort_timeout_s)
        except KvmeshError as exc:
            log.warning("abort of %s on %s failed: %s", request_id, engine.id, exc)

    async def close(self) -> None:
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self._clients.values()))
