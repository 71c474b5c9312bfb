"""LayerKV's execution side (3.1.2, 4): running layers whose KV lives in the cxl tier.

The attention kernel reads KV in place from the device pool, so an offloaded layer is computed in a
staging area of device blocks the scheduler lends for the step from the free ones (Plan.staging).
Each step, every request with offloaded layers gets the same slice of staging blocks in each such
layer; the layers take turns between the two halves of the area. Around each staged layer's attention:

- before: wait for this layer's load (its context, cxl -> staging) and start the next staged
  layer's load into the other half, so it overlaps this layer's compute;
- after: start the write-back of the blocks this step wrote (cxl <- staging): a prefill's new KV
  goes to the cxl tier right after its layer computes, and the staging blocks are free again once
  it has.

Copies run off the compute path on a GPU, on a side stream (its copy engines). On a CPU the copy
engine is a core: by default copies run inline, as a worker thread only competes with torch's
intra-op threads for the same cores (on 2 cores, 2 threads: a decode step of the `small` model with
every layer staged took 9.4 ms with a worker thread against 5.2 ms inline and 5.1 ms without the
copies); `thread=True` puts them on a worker thread, for a CPU with cores to spare. They go in chunks,
each waiting while the link is busy (3.1.3): `LinkMonitor` is where a tensor-parallel engine reports
its all-reduce traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvmesh.policies.iteration import ScheduledChunk
from kvmesh.policies.views import blocks_for

from .pool_copy import copy_blocks
from .kv_pool import KVPool

Copy = tuple[KVPool, list[int], KVPool, list[int]]  # source pool and blocks, target pool and blocks


class LinkMonitor(Protocol):
    def busy(self) -> bool:
        """Whether something on the critical path (an all-reduce over PCIe) is using the link now."""


class IdleLink:
    """A link nothing else uses: a single-device engine, or GPUs that all-reduce over NVLink."""

    def busy(self) -> bool:
        return False


@dataclass
class ChunkedCopier:
    """Copies whole blocks between pools `chunk_blocks` at a time, waiting before each chunk while
    the link is busy (LayerKV 3.1.3: a swap never starts inside an all-reduce)."""

    link: LinkMonitor = field(default_factory=IdleLink)
    chunk_blocks: int = 64
    backoff_s: float = 50e-6   # a fraction of an all-reduce
    waits: int = 0             # checks that found the link busy, all time

    def __call__(self, source: KVPool, source_blocks: list[int], target: KVPool, target_blocks: list[int]) -> None:
        for start in range(0, len(source_blocks), self.chunk_blocks):
            while self.link.busy():
                self.waits += 1
                time.sleep(self.backoff_s)
            end = start + self.chunk_blocks
            copy_blocks(source, source_blocks[start:end], target, target_blocks[start:end])


class SideCopies:
    """Runs a batch of copies off the compute path (a side stream, or a worker thread if `thread`),
    or inline on a CPU, and lets the compute wait for it."""

    def __init__(self, device: torch.device, copy: Callable[..., None], thread: bool = False):
        self.copy = copy
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="kv-layer-copy") if thread and not self.stream else None

    def start(self, copies: Sequence[Copy]) -> Future | torch.cuda.Event:
        if self.worker is not None:
            return self.worker.submit(self._run, copies)
        if self.stream is None:
            done = Future()
            self._run(copies)
            done.set_result(None)
            return done
        self.stream.wait_stream(torch.cuda.current_stream())  # after what the compute wrote or still reads
        with torch.cuda.stream(self.stream):
            self._run(copies)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, handle: Future | torch.cuda.Event) -> None:
        if isinstance(handle, Future):
            handle.result()
        else:
            torch.cuda.current_stream().wait_event(handle)

    def settle(self, handle: Future | torch.cuda.Event) -> None:
        """Wait until the copy is really done (the host may then reuse or free what it touched)."""
        if isinstance(handle, Future):
            handle.result()
        else:
            handle.synchronize()

    def _run(self, copies: Sequence[Copy]) -> None:
        for source, source_blocks, target, target_blocks in copies:
            if source_blocks:
                self.copy(source, source_blocks, target, target_blocks)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


@dataclass
class _StagedLayer:
    loads: list[Copy]
    writes: list[Copy]


class StagedStep:
    """One step's staged layers: the block tables with staging blocks in place of the offloaded
    layers' cxl blocks, and the copies around each staged layer's attention."""

    def __init__(self, tables: np.ndarray, layers: dict[int, _StagedLayer], side: SideCopies):
        self.tables, self.side = tables, side
        self._order = sorted(layers)
        self._layers = layers
        self._loads: dict[int, Future | torch.cuda.Event] = {}
        self._writes: list[Future | torch.cuda.Event] = []

    def wrap(self, attention: Callable) -> Callable:
        def staged(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer not in self._layers:
                return attention(layer, q, k, v)
            self._before(layer)
            out = attention(layer, q, k, v)
            self._writes.append(self.side.start(self._layers[layer].writes))
            return out
        return staged

    def _before(self, layer: int) -> None:
        if layer not in self._loads:
            self._loads[layer] = self.side.start(self._layers[layer].loads)
        self.side.wait(self._loads.pop(layer))
        position = self._order.index(layer)
        if position + 1 < len(self._order):  # the next staged layer loads into the other half meanwhile
            following = self._order[position + 1]
            self._loads[following] = self.side.start(self._layers[following].loads)

    def finish(self) -> None:
        """Wait for every copy of the step: the cxl tier then holds what this step computed."""
        for handle in [*self._loads.values(), *self._writes]:
            self.side.settle(handle)
        self._loads, self._writes = {}, []


@dataclass(frozen=True)
class NodeLoads:
    """A step's copies of prefix-cache nodes from the cxl tier into the device pool, one a layer:
    `reloads`, the nodes of requests the step runs (their turn, III-C.1), and `prefetches`, the nodes
    the prefetcher gave device blocks for requests still waiting (III-B.2), which no attention of
    the step reads. Either may be empty."""

    reloads: list[Copy]
    prefetches: list[Copy]


class LayerLoads:
    """CaR III-C.1: a step's reloads of prefix-cache nodes, layer by layer, each layer's copy done
    before that layer's attention. On a GPU (or a copy thread) every layer's copy starts with the
    step, in layer order, and a layer waits only for its own: later layers load while earlier ones
    compute. Inline on a CPU, each layer copies right before its attention. The step's prefetches
    (III-B.2) go after the reloads on the same copier, waited for by no attention, only by `finish`:
    under the step's compute on a GPU or a copy thread, after it inline."""

    def __init__(self, side: SideCopies, loads: NodeLoads):
        self.side, self.copies, self.prefetches = side, loads.reloads, loads.prefetches
        eager = side.stream is not None or side.worker is not None
        self._handles = [side.start([copy]) if eager else None for copy in self.copies]
        self._prefetching = side.start(self.prefetches) if eager and self.prefetches else None

    def wrap(self, attention: Callable) -> Callable:
        if not self.copies:
            return attention

        def loaded(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self._handles[layer] is None:
                self._handles[layer] = self.side.start([self.copies[layer]])
            self.side.wait(self._handles[layer])
            return attention(layer, q, k, v)
        return loaded

    def finish(self) -> None:
        """Wait for every layer's copy (those of layers the step never reached, and the prefetches
        inline, are started now)."""
        for layer, handle in enumerate(self._handles):
            self.side.settle(handle if handle is not None else self.side.start([self.copies[layer]]))
        if self.prefetches:
            self.side.settle(self._prefetching if self._prefetching is not None else self.side.start(self.prefetches))


class LayerStaging:
    """The copies in and out of a step's staging area in a device pool."""

    def __init__(self, device: KVPool, cxl: KVPool, copier: ChunkedCopier, thread: bool = False):
        self.device, self.cxl, self.copier = device, cxl, copier
        self.side = SideCopies(device.tensor.device, copier, thread)
        self.staged_bytes = 0  # the last prepared step's copies, loads and write-backs (its step record's)

    def prepare(self, chunks: Sequence[ScheduledChunk], tables: np.ndarray,
                area: tuple[list[int], list[int]]) -> StagedStep | None:
        """The step's staged layers in `area` (the two halves lent for the step), or None when no
        request in the step has an offloaded layer."""
        block_size = self.device.shape.block_size
        offsets, used = [], 0   # each staged sequence's first block within a half
        for chunk in chunks:
            offsets.append(used)
            if chunk.request.offloaded:
                used += chunk.request.blocks_per_layer
        self.staged_bytes = 0
        if used == 0:
            return None
        if used > min(map(len, area)):
            raise AssertionError(f"the step stages {used} blocks a layer, its staging area's halves hold "
                                 f"{[len(half) for half in area]}")
        tables = tables.copy()  # the runner keeps its tables across steps
        # Staged layers alternate between the halves in the order they compute.
        halves = {layer: i % 2 for i, layer in enumerate(sorted({l for c in chunks for l in c.request.offloaded}))}
        # Per staged layer, every request's blocks in one copy each way: one gather, not one per request.
        loads = {layer: ([], []) for layer in halves}
        writes = {layer: ([], []) for layer in halves}
        for s, chunk in enumerate(chunks):
            request = chunk.request
            loaded = blocks_for(request.num_computed, block_size)      # blocks holding context already computed
            written = request.num_computed // block_size                # first block this step writes into
            for layer in request.offloaded:
                staged = area[halves[layer]][offsets[s]:offsets[s] + request.blocks_per_layer]
                cxl_blocks = request.layers[layer].blocks
                tables[layer, s, :len(staged)] = staged
                loads[layer][0].extend(cxl_blocks[:loaded])
                loads[layer][1].extend(staged[:loaded])
                writes[layer][0].extend(staged[written:])
                writes[layer][1].extend(cxl_blocks[written:])
        copied = sum(len(loads[layer][0]) + len(writes[layer][0]) for layer in halves)
        self.staged_bytes = copied * self.device.shape.bytes
        layers = {layer: _StagedLayer([(self.cxl, loads[layer][0], self.device, loads[layer][1])],
                                      [(self.device, writes[layer][0], self.cxl, writes[layer][1])])
                  for layer in halves}
        return StagedStep(tables, layers, self.side)

    def close(self) -> None:
        self.side.close()
