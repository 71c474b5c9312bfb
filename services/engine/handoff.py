"""The KV hand-off between a prefill engine and a decode engine (docs/serving.md): the handle a
prefill engine returns with the first token, and how a decode engine checks one it is given."""

from __future__ import annotations

from typing import Annotated, Protocol

from msgspec import Meta, Struct

from kvmesh.libs.controlplane import BadRequest
from kvmesh.libs.kvmeta.messages import Id

BlockIds = Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=1 << 16)]


class KVHandle(Struct, kw_only=True, frozen=True):
    """Where a request's prompt KV sits: on which engine (control id and data-plane address), under
    which request id there, how many tokens, and each layer's blocks in order."""

    engine: Id
    data_address: Annotated[str, Meta(min_length=1, max_length=256)]
    request_id: Id
    num_tokens: Annotated[int, Meta(gt=0)]
    block_size: Annotated[int, Meta(gt=0)]
    layers: Annotated[list[BlockIds], Meta(max_length=1024)]
    # Each layer's tier on that engine ("device" or "cxl", where LayerKV keeps some); None: all device.
    tiers: Annotated[list[Annotated[str, Meta(pattern="^(device|cxl)$")]], Meta(max_length=1024)] | None = None

    def check(self, num_layers: int, block_size: int, kv_tokens: int) -> None:
        """400 unless the handle fits this engine and a prompt whose first `kv_tokens` have KV there."""
        if self.block_size != block_size or len(self.layers) != num_layers:
            raise BadRequest(f"kv_source: blocks of {self.block_size} tokens in {len(self.layers)} layers do not fit "
                             f"this engine ({block_size} tokens, {num_layers} layers)")
        if self.num_tokens != kv_tokens:
            raise BadRequest(f"kv_source holds {self.num_tokens} tokens, but all but the last of the "
                             f"{kv_tokens + 1} prompt tokens ({kv_tokens}) must have KV there")
        if self.tiers is not None and len(self.tiers) != len(self.layers):
            raise BadRequest(f"kv_source: {len(self.tiers)} tiers for {len(self.layers)} layers")
        needed = -(-kv_tokens // block_size)
        if any(len(blocks) < needed for blocks in self.layers):
            raise BadRequest(f"kv_source: every layer needs {needed} blocks for {kv_tokens} tokens")


class KVTransfer(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """On a prefill engine: keep the prompt's KV for a decode engine to pull (pull mode), or write
    it into the blocks a decode engine reserved (push mode, `target` from its /v1/kv/reserve)."""

    mode: Annotated[str, Meta(pattern="^(pull|push)$")] = "pull"
    target: KVHandle | None = None


class KVReserve(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/kv/reserve` on a decode engine (push mode): blocks for `num_tokens` tokens of KV."""

    request_id: Id
    num_tokens: Annotated[int, Meta(gt=0)]


class TransferStats(Struct, kw_only=True, frozen=True):
    """What one request's KV pull moved, for its trace and the transfer metrics."""

    bytes: int
    pieces: int        # contiguous block pieces asked for
    reads_posted: int  # reads posted after coalescing
    seconds: float     # from the first read posted to the prefill side's ACK of COMPLETE
    backend: str       # tcp | shm | verbs
    peer: str          # the prefill engine's data-plane address


class KVPushTarget(Protocol):
    """What the engine thread asks of a push in flight (dataplane.KVPush)."""

    def layer_done(self, layer: int, blocks: list[int]) -> None: ...

    def wait(self) -> str | None: ...
