"""The models the cluster serves, and each model's tokenizer, fetched once from one of its engines.

An engine's `GET /v1/tokenizer` gives the `tokenizers` serialisation, the special tokens, the chat
template and the context limit; admission rebuilds a `PreTrainedTokenizerFast` from it, so it
tokenizes exactly as the engine would, without the checkpoint on its own disk.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast  # at import: transformers' lazy imports are not thread-safe

from kvmesh.libs.controlplane import KvmeshError
from kvmesh.libs.messages.engine import TokenizerSpec
from kvmesh.libs.messages.scheduler import EngineStatus

from .engine_client import EngineClients
from .openai_api import OpenAIError
from .upstreams import Upstreams

# Used when a model's tokenizer has no chat template of its own: each turn as "role: content" on its
# own line, after the BOS token when the tokenizer has one, then "assistant:" for the reply.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class ModelTokenizer:
    model: str
    tokenizer: object  # transformers.PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def encode(self, prompt: str) -> list[int]:
        """A completion prompt, with the special tokens the model expects (BOS), as the engine encodes it."""
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation through the chat template, ready for the assistant's reply."""
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def build_tokenizer(spec: TokenizerSpec) -> ModelTokenizer:

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec.tokenizer_json),
                                        chat_template=spec.chat_template or DEFAULT_CHAT_TEMPLATE,
                                        clean_up_tokenization_spaces=False, **spec.special_tokens)
    return ModelTokenizer(spec.model, tokenizer, tuple(spec.eos_token_ids), spec.max_model_len)


class Models:
    """What the cluster serves (the scheduler's view, re-read at most every `refresh_s`), and the
    tokenizer of each model (fetched on first use, then kept)."""

    def __init__(self, upstreams: Upstreams, engines: EngineClients, refresh_s: float):
        self.upstreams = upstreams
        self.engines = engines
        self.refresh_s = refresh_s
        self._engines: list[EngineStatus] = []
        self._read_at = -float("inf")
        self._tokenizers: dict[str, asyncio.Task[ModelTokenizer]] = {}

    async def live(self, fresh: bool = False) -> list[EngineStatus]:
        if fresh or time.monotonic() - self._read_at > self.refresh_s:
            try:
                self._engines = (await self.upstreams.scheduler.cluster()).engines
            except KvmeshError as exc:
                raise OpenAIError(503, f"the scheduler cannot list the cluster: {exc.message}", type="server_error",
                                  code="no_engine") from None
            self._read_at = time.monotonic()
        return self._engines

    async def names(self) -> list[str]:
        return sorted({engine.model for engine in await self.live()})

    async def tokenizer(self, model: str) -> ModelTokenizer:
        """The model's tokenizer; 404 `model_not_found` when no live engine serves it. Concurrent
        first requests share one fetch (the task is registered before anything is awaited)."""
        task = self._tokenizers.get(model)
        if task is None or (task.done() and task.exception() is not None):
            task = self._tokenizers[model] = asyncio.ensure_future(self._fetch(model))
        return await asyncio.shield(task)

    async def _fetch(self, model: str) -> ModelTokenizer:
        engines = [e for e in await self.live() if e.model == model] or \
                  [e for e in await self.live(fresh=True) if e.model == model]
        if not engines:
            raise OpenAIError(404, f"the model `{model}` does not exist or no engine serves it",
                              param="model", code="model_not_found")
        last: KvmeshError | None = None
        for engine in engines:
            try:
                spec = await self.engines.tokenizer(engine.ref())
            except KvmeshError as exc:
                last = exc
                continue
            return await asyncio.to_thread(build_tokenizer, spec)
        raise OpenAIError(503, f"no engine of the model gave its tokenizer: {last}", type="server_error",
                          code="no_engine")
