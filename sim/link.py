"""The KV hand-off's time over a link: KVDirect's pull (libs/rdma/kvdirect/puller.py), one-sided
reads of the prompt's blocks and a COMPLETE the prefill engine ACKs; or its push, each layer's blocks
written as the prefill computes the layer.

    seconds = latency + per_read * reads + bytes / bandwidth

- latency: one COMPLETE/ACK round trip per transfer (CONNECT is once per peer, not per request);
- reads: a block of one layer is one read (two with `kv_apart`: vLLM's cache keeps a layer's K and
  V blocks in two regions, KVDirect Figure 5's "two disjoint memory spaces"); with coalescing
  (docs/dataplane.md), reads whose remote and local ranges are both contiguous are merged, so each
  layer takes one read per contiguous run of blocks (per region): `block_runs` a layer, 1 when a
  request's blocks are contiguous on both sides;
- bytes: whole blocks, as the puller reads them: K and V of `block_size` tokens, per layer.

A pair (one prefill engine, one decode engine: one puller connection) serves its transfers first
come, first served: a transfer's reads start when the one before it has landed. The COMPLETE/ACK
round trip does not hold the connection (the puller keeps posting other requests' reads while it
waits for an ACK). The pairs of one prefill engine share its bandwidth (shared_link.py).

Push: a prefill step computing a chunk of the prompt reaches its layers one after another, evenly
over the step; each layer's share of the chunk's writes is queued on the link when its layer is
done. So the writes overlap the prefill, and what is left after the step is the last layer's write
(more if the link is slower than the layers), then the ACK.

Defaults: loopback tcp on this machine, from `kvmesh bench transfer` (docs/benchmarks.md,
"transfer", 2,048 blocks in 451 coalesced runs): the reads landed at 3.09 GB/s at 32 KB blocks and
the COMPLETE/ACK round trip is 0.5-1.4 ms, so 1 ms; without coalescing 2,048 reads of 4 KB took
3.1 ms more than 451 (1.20 against 2.15 GB/s), about 2 us a read; what is left of the 32 KB time,
3.2 GB/s."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.policies.views import blocks_for


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The model's KV: the default is `tiny` (services/engine/native/models/presets.py) in bfloat16,
    the model of the committed step-cost profile."""

    num_layers: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype_bytes: int = 2

    @classmethod
    def parse(cls, text: str) -> KVGeometry:
        """`LAYERS:KV_HEADS:HEAD_DIM:DTYPE_BYTES`, e.g. 32:8:128:2."""
        parts = text.split(":")
        if len(parts) != 4 or not all(part.isdigit() and int(part) >= 1 for part in parts):
            raise ValueError(f"KV geometry {text!r}: give LAYERS:KV_HEADS:HEAD_DIM:DTYPE_BYTES, each at least 1, "
                             f"e.g. 32:8:128:2")
        return cls(*(int(part) for part in parts))

    def block_bytes(self, block_size: int) -> int:
        """One block of one layer: K and V of `block_size` tokens."""
        return 2 * block_size * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class LinkSpec:
    gbps: float = 3.2             # GB/s (1e9 bytes a second) the reads move
    latency_us: float = 1000.0    # each transfer's COMPLETE/ACK round trip
    per_read_us: float = 2.0      # each read posted
    coalescing: bool = True
    block_runs: int = 1           # contiguous runs a request's blocks make in a layer (1: contiguous)
    kv_apart: bool = False        # K and V of a block in two regions (vLLM's layout): two reads a block

    def __post_init__(self) -> None:
        if self.gbps <= 0 or self.latency_us < 0 or self.per_read_us < 0 or self.block_runs < 1:
            raise ValueError(f"link: bandwidth must be > 0, latency and per-read cost >= 0, block runs >= 1; "
                             f"got {self.gbps} GB/s, {self.latency_us} us, {self.per_read_us} us, {self.block_runs}")

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True, slots=True)
class Transfer:
    bytes: int
    reads: int
    data_s: float       # the reads: what holds the link
    bytes_s: float      # of data_s, the bytes over the bandwidth (what transfers sharing the link split)
    latency_s: float    # the COMPLETE/ACK round trip after them

    @property
    def seconds(self) -> float:
        return self.data_s + self.latency_s


def pull(link: LinkSpec, geometry: KVGeometry, block_size: int, tokens: int) -> Transfer:
    """Pulling the KV of `tokens` tokens (whole blocks of `block_size`), alone on the link."""
    return _blocks(link, geometry, block_size, blocks_for(tokens, block_size))


def push(link: LinkSpec, geometry: KVGeometry, block_size: int, computed: int, n: int) -> Transfer:
    """Writing the blocks a chunk of `n` tokens after `computed` fills (a block it completes that an
    earlier chunk began is written again), alone on the link."""
    return _blocks(link, geometry, block_size, blocks_for(computed + n, block_size) - computed // block_size)


def _blocks(link: LinkSpec, geometry: KVGeometry, block_size: int, blocks: int) -> Transfer:
    runs = min(blocks, link.block_runs) if link.coalescing else blocks
    reads = runs * geometry.num_layers * (2 if link.kv_apart else 1)
    size = blocks * geometry.num_layers * geometry.block_bytes(block_size)
    bytes_s = size / (link.gbps * 1e9)
    return Transfer(size, reads, link.per_read_us * 1e-6 * reads + bytes_s, bytes_s, link.latency_s)

