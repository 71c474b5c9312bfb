"""Typed bodies of the kvmeta API: the worker registry, the cache table and the block map.

Every body on the wire is one of these structs, in msgpack (services) or JSON (people).
Validation happens when a body is decoded; a handler never sees a malformed one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct, field

# Names that end up inside Redis keys: no spaces, no braces (those are Redis Cluster hash tags).
Id = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$",
                         description="worker, engine or request id")]
NodeId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
                             description="a prefix block's name: chained hash of its parent and its tokens")]
Role = Literal["prefill", "decode", "both"]
Tier = Literal["device", "cxl"]
NonNegative = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(gt=0)]
Score = Annotated[float, Meta(ge=-1e12, le=1e12)]
TtlMs = Annotated[int, Meta(ge=100, le=3_600_000, description="milliseconds")]
MAX_ITEMS = 65_536


# -- worker registry ------------------------------------------------------------------------------

class BlockGeometry(Struct, kw_only=True, frozen=True):
    """Shape of one KV block: one layer's K and V for `block_size` tokens."""

    block_size: Positive
    num_layers: Positive
    num_kv_heads: Positive
    head_dim: Positive
    dtype: Annotated[str, Meta(max_length=32)]


class GpuNic(Struct, kw_only=True, frozen=True):
    """GPU i sits beside this NIC; decode GPU i pairs with prefill GPU i (KVDirect 4.2)."""

    gpu: NonNegative
    nic: Annotated[str, Meta(max_length=64)]
    address: Annotated[str, Meta(max_length=256)]


class Capacity(Struct, kw_only=True, frozen=True):
    device_blocks: NonNegative
    cxl_blocks: NonNegative = 0


class WorkerInfo(Struct, kw_only=True, frozen=True):
    """What a worker says about itself when it registers."""

    id: Id
    role: Role
    control_url: Annotated[str, Meta(min_length=1, max_length=256)]
    data_address: Annotated[str, Meta(max_length=256)] = ""
    model: Annotated[str, Meta(max_length=256)]
    geometry: BlockGeometry
    # whose engine lays the blocks out: KV moves only between engines of one backend and geometry
    backend: Annotated[str, Meta(max_length=32)] = "native"
    pairing: Annotated[list[GpuNic], Meta(max_length=64)] = field(default_factory=list)
    capacity: Capacity


class Load(Struct, kw_only=True, frozen=True):
    """What a worker reports in each heartbeat; the scheduler routes on it."""

    free_blocks: dict[Tier, NonNegative] = field(default_factory=dict)
    waiting: NonNegative = 0
    running: NonNegative = 0
    swapped: NonNegative = 0


class WorkerRegistration(Struct, kw_only=True, frozen=True):
    worker: WorkerInfo
    ttl_ms: TtlMs = 5_000


class Heartbeat(Struct, kw_only=True, frozen=True):
    load: Load | None = None
    ttl_ms: TtlMs | None = None


class HeartbeatAck(Struct, kw_only=True, frozen=True):
    heartbeat_ms: int
    deadline_ms: int


class Worker(Struct, kw_only=True, frozen=True):
    """A live worker as the registry holds it. Times are Redis server time, ms since the epoch."""

    info: WorkerInfo
    load: Load
    ttl_ms: int
    registered_ms: int
    heartbeat_ms: int
    deadline_ms: int


class WorkerList(Struct, kw_only=True, frozen=True):
    workers: list[Worker]
    now_ms: int


class WorkerEvent(Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One event of the watch stream. The first is always a `snapshot` of the live workers, so a
    watcher needs no separate list call and misses nothing between listing and watching."""

    kind: Literal["snapshot", "join", "leave"]
    at_ms: int
    worker_id: str | None = None
    worker: WorkerInfo | None = None
    workers: list[Worker] | None = None
    reason: str | None = None


class WorkerPath(Struct, kw_only=True, frozen=True):
    worker_id: Id


class Removed(Struct, kw_only=True, frozen=True):
    removed: bool


# -- cache table (CaR) ----------------------------------------------------------------------------

class CacheEntry(Struct, kw_only=True, frozen=True):
    """One prefix block an engine holds: CaR's cache-table row (NodeID, tier for Valid_in_GPU, Size, Score)."""

    node_id: NodeId
    tier: Tier
    size: NonNegative
    score: Score = 0.0


class CachePublish(Struct, kw_only=True, frozen=True):
    engine: Id
    entries: Annotated[list[CacheEntry], Meta(max_length=MAX_ITEMS)]


class CacheEvict(Struct, kw_only=True, frozen=True):
    engine: Id
    node_ids: Annotated[list[NodeId], Meta(max_length=MAX_ITEMS)]


class ScoreDelta(Struct, kw_only=True, frozen=True):
    node_id: NodeId
    delta: Score


class CacheScores(Struct, kw_only=True, frozen=True):
    """Score changes, applied atomically (CaR: +1 entering the window, +1 running, -2 finished)."""

    engine: Id
    deltas: Annotated[list[ScoreDelta], Meta(max_length=MAX_ITEMS)]


class PrefixLookup(Struct, kw_only=True, frozen=True):
    """A prompt's NodeIDs in order, first block first."""

    node_ids: Annotated[list[NodeId], Meta(max_length=MAX_ITEMS)]


class PrefixMatch(Struct, kw_only=True, frozen=True):
    """A live holder and how many leading blocks of the looked-up prefix it has (and of those, how
    many sit in its device tier)."""

    engine: str
    blocks: int
    device_blocks: int


class PrefixMatches(Struct, kw_only=True, frozen=True):
    matches: list[PrefixMatch]  # longest first


class Count(Struct, kw_only=True, frozen=True):
    count: int


# -- block map ------------------------------------------------------------------------------------

class BlockLease(Struct, kw_only=True, frozen=True):
    """Blocks an engine holds for a request until a peer pulls them or the lease runs out."""

    engine: Id
    layers: Annotated[list[Annotated[list[NonNegative], Meta(max_length=MAX_ITEMS)]], Meta(max_length=1024)]
    token_count: NonNegative
    tier: Tier = "device"
    lease_ms: TtlMs = 30_000


class BlockRecord(Struct, kw_only=True, frozen=True):
    request_id: str
    engine: str
    layers: list[list[int]]
    token_count: int
    tier: Tier
    deadline_ms: int


class BlockRecords(Struct, kw_only=True, frozen=True):
    records: list[BlockRecord]
    now_ms: int


class BlockPath(Struct, kw_only=True, frozen=True):
    request_id: Id


class BlockQuery(Struct, kw_only=True, frozen=True):
    """`GET /v1/blocks`: leases past their deadline (default), or all of them, of one engine or of all."""

    engine: Id | None = None
    expired: bool = True
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 1_000
