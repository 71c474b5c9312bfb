"""What the engine service (app.py) needs of an engine: one contract, two backends (the native torch
engine in native/, stock vLLM in vllm_backend/). A backend steps its engine on a thread of its own
and hands each step's frames to `on_frames` there; every other call comes from the service's event
loop. Whatever a backend cannot do is a BadRequest that says so."""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvmesh.libs.controlplane import BadRequest
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import BlockGeometry, Capacity, GpuNic
from kvmesh.libs.messages.engine import (CacheQuery, CacheTable, Frame, GenerateRequest, KVHandle, SamplingParams,
                                         TokenizerSpec)

from .cache_publisher import CacheJournal
from .metrics import EngineCollector
from .state import EngineState
from .steps import EngineSteps


class EngineBackend(abc.ABC):
    name: str                            # the registry's `backend`: KV moves only between engines of one
    collector: type[EngineCollector]     # its Prometheus series
    tokenizer: Any                       # a transformers tokenizer of the model
    vocab_size: int
    context_limit: int                   # the longest prompt + output one request may have
    tokenizer_spec: TokenizerSpec
    geometry: BlockGeometry
    capacity: Capacity
    data_address: str                    # where other engines reach its KV ("" without a data plane)
    pairing: list[GpuNic]                # the GPU-NIC pairs it registers in kvmeta ([] without a data plane)

    @abc.abstractmethod
    def start(self, on_frames: Callable[[list[Frame]], None]) -> None:
        """Build the engine and start stepping it; `on_frames` takes each step's frames, on its thread."""

    async def __aenter__(self) -> EngineBackend:
        """What runs while the service serves (a data plane); the engine stops on exit."""
        return self

    @abc.abstractmethod
    async def __aexit__(self, *exc: object) -> None: ...

    @abc.abstractmethod
    def state(self) -> EngineState:
        """The latest snapshot, replaced whole by the engine's thread (never changed in place)."""

    def steps(self, since: int) -> EngineSteps:
        """The recent steps after step `since`, as the loop stepping the engine timed them."""
        raise BadRequest(f"steps: the {self.name} backend does not record its steps (vLLM steps in its engine "
                         "core's own process and loop)")

    def clock(self) -> float:
        """Now, on the clock a request's `arrival` is kept in."""
        return time.time()

    @abc.abstractmethod
    async def add(self, request_id: str, body: GenerateRequest, ids: list[int], sampling: SamplingParams,
                  arrival: float) -> None:
        """Queue a request whose frames go to `on_frames`; a BadRequest if this engine cannot take it
        (its hand-off, or what the engine itself refuses)."""

    def ended(self, request_id: str, last: Frame | None) -> None:
        """A request's stream ended: with its last frame, or None when the client went away (abort it)."""
        if last is None:
            self.abort_soon(request_id)

    @abc.abstractmethod
    def abort_soon(self, request_id: str) -> None:
        """Abort without waiting for it (a client went away)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; its stream ends with finish_reason `abort`. False if it
        was not here."""

    @abc.abstractmethod
    async def abort_all(self, request_ids: list[str]) -> None:
        """At shutdown: abort these, so every open stream ends."""

    @abc.abstractmethod
    async def set_policies(self, policies: dict[str, str]) -> dict[str, str]:
        """Switch engine-level policies by name between two steps; KeyError for a name it lacks."""

    async def reserve(self, request_id: str, num_tokens: int) -> KVHandle:
        """Push mode: blocks for a prompt's KV a prefill engine will write, once they are given."""
        raise BadRequest(f"kv/reserve: push mode is the native engine's; the {self.name} backend hands KV off "
                         "in pull mode only")

    async def cache_table(self, query: CacheQuery) -> CacheTable:
        """CaR's cache table: the prefix cache's nodes with their tier, blocks, size and score."""
        raise BadRequest(f"cache: CaR's cache table is the native engine's, not the {self.name} backend's")

    def cache_journal(self) -> tuple[CacheJournal, Callable[[Callable[[], Any]], Awaitable[Any]]] | None:
        """The prefix cache as kvmeta's cache table is kept from it, and how to read it on the engine's
        thread; None when there is nothing to publish."""
        return None

    @contextlib.asynccontextmanager
    async def registered(self, kvmeta: KvmetaClient) -> AsyncIterator[None]:
        """While this engine is in kvmeta's registry (the native hand-off follows it)."""
        yield


def tokenizer_spec(model: str, tokenizer: Any, eos_token_ids: list[int], context_limit: int) -> TokenizerSpec:
    """What a front door needs to tokenize for this model itself."""
    special = {name: value for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if isinstance(value := getattr(tokenizer, name, None), str)}
    return TokenizerSpec(model=model, tokenizer_json=tokenizer.backend_tokenizer.to_str(),
                         chat_template=getattr(tokenizer, "chat_template", None), special_tokens=special,
                         eos_token_ids=eos_token_ids, max_model_len=context_limit)
