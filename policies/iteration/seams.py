"""What the iteration scheduler (scheduler.py) asks of a request, of the block accounting and of
CaR's reuse: the native engine passes its Request, BlockManager and Reuse; the simulator passes its
SimRequest and a count of blocks (sim/block_count.py, or sim/layer_count.py layer by layer). The
`Layered` parts are asked for only with layer-wise offloading on (LayerKV)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from ..allocation.ledger import Allottee
from ..cache.node_table import PrefixHit
from ..views import PoolView, RequestView
from .status import Status


class Schedulable(Allottee, Protocol):
    """A request; besides the ledger's fields the scheduler moves `num_computed` (back to 0 on a
    recompute), `status`, `preemptions`, `scheduled_at`, `num_cached` and `finish_reason`."""

    num_computed: int
    status: Status
    preemptions: int
    scheduled_at: float | None    # when it first got blocks (to compute, or for KV to pull)
    num_cached: int               # of its prompt, tokens the prefix cache gave it
    finish_reason: str | None

    @property
    def awaits_kv(self) -> bool:
        """Decode role: its first num_tokens - 1 tokens' KV comes from a prefill engine."""

    def view(self) -> RequestView: ...


class LayeredRequest(Schedulable, Protocol):
    layers: Sequence            # per layer, an object with the `tier` its KV is in
    push: object | None         # prefill role, push mode: where its KV is written as it is computed

    @property
    def offloaded(self) -> list[int]:
        """Layers whose KV is in the cxl tier while it runs."""


class Blocks(Protocol):
    """An engine's blocks: per tier and layer, who holds how many. `reserve` and the swaps are all
    or nothing; `free` counts blocks of every layer together."""

    block_size: int
    num_layers: int

    def free(self, tier: str) -> int: ...

    def pool_view(self) -> PoolView: ...

    def reserve(self, request: Schedulable, blocks_per_layer: int, new_tokens: int) -> bool: ...

    def release(self, request: Schedulable) -> None: ...

    def swap_out(self, request: Schedulable) -> bool: ...

    def swap_in(self, request: Schedulable) -> bool: ...

    def find_prefix(self, request: Schedulable) -> PrefixHit:
        """What attach_prefix would give the request and take of the device, nothing attached or moved."""

    def attach_prefix(self, request: Schedulable, now: float) -> int:
        """Give a request with no blocks its longest cached prefix; the tokens it need not compute."""

    def commit(self, request: Schedulable, now: float) -> None:
        """Offer the request's full blocks to the prefix cache."""

    def forget_scores(self, request: Schedulable) -> None:
        """CaR: take what the ended request added back from its cached nodes' scores."""


class LayeredBlocks(Blocks, Protocol):
    def place(self, request: LayeredRequest, device_layers: Sequence[int]) -> bool: ...

    def move_layers(self, request: LayeredRequest, layers: Iterable[int], tier: str) -> bool: ...

    def lend(self, n: int) -> list[int]: ...


class Reuse(Protocol):
    """CaR's side of admission (reuse.py): the Shuffled Window and the scores before it, the prefetcher after."""

    def before_admission(self, waiting: list, now: float) -> None: ...

    def after_admission(self, waiting: list, running: list, now: float, tpop_s: float) -> None: ...

    def admitted(self, request: Schedulable) -> None: ...
