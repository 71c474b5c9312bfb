"""KVDirect's push mode (KVDirect Fig. 10, the baseline to its pull): the side that computes the KV
writes it one-sided into blocks the other side reserved, a layer at a time while its forward pass
goes on, over a connection a KVDirectPuller made (CONNECT once per peer, the peer's descriptors).

`KVDirectPusher.push` starts one request's push; the returned `LayerPush` takes each layer's blocks
as a step computes them (`layer_done`, from the computing thread, in every step that computes a
chunk; the post does not block), then `finish` says nothing more comes, and `landed` resolves once
every write is ACKed: the first token waits for it, so the reader finds every byte in place, while
the computing thread goes on with other work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

import numpy as np
import torch

from ..work import RdmaError, Segments
from .puller import KVDirectPuller, PullConnection


class LayerPush:
    """One request's KV pushed into a peer's blocks, `remote_layers[layer]` for each layer."""

    def __init__(self, connection: PullConnection, pool: str, remote_layers: Sequence[Sequence[int]],
                 loop: asyncio.AbstractEventLoop, timeout: float):
        self.connection, self.remote_layers, self.loop, self.timeout = connection, remote_layers, loop, timeout
        self.remote = connection.remote[pool]
        self.region, self.local = connection.local[pool]
        self.landed: concurrent.futures.Future[str | None] = concurrent.futures.Future()  # None, or why not
        self._on_device = self.region.buffer.device.startswith("cuda")
        self._posted: list[int] = []
        self._last_deferred: concurrent.futures.Future | None = None  # on a GPU: the last layer's post
        self._error: str | None = None

    def layer_done(self, layer: int, first: int, blocks: Sequence[int]) -> None:
        """On the computing thread: this layer's KV for the reserved blocks from `first` on is in
        `blocks` of the local pool; write it out."""
        if self._error is not None or not blocks:
            return
        try:
            remote_offsets, size = self.remote.extents(np.asarray(self.remote_layers[layer][first:first + len(blocks)]))
        except IndexError as exc:  # blocks the peer does not have: this push fails, not the computing step
            self._error = str(exc)
            return
        local_offsets, _ = self.local.extents(np.asarray(blocks))
        segments = Segments(local_offsets, self.remote.addr + remote_offsets,
                            np.full(len(local_offsets), size, dtype=np.int64)).coalesced()
        if not self._on_device:
            self._post(segments)
            return
        # The NIC reads what the layer's kernels wrote: an event per layer, waited for off the computing
        # thread, and the posts kept in order (a block written again must land after its first write).
        written = torch.cuda.Event()
        written.record()
        self._last_deferred = asyncio.run_coroutine_threadsafe(
            self._post_after(self._last_deferred, written, segments), self.loop)

    def finish(self) -> None:
        """On the computing thread: every write is posted; `landed` resolves once they are ACKed."""
        asyncio.run_coroutine_threadsafe(self._land(), self.loop)

    def _post(self, segments: Segments) -> None:
        if self._error is not None:
            return
        wr_id = self.connection.qp.endpoint.next_wr_id()
        try:
            self.connection.qp.post_write(wr_id, self.region, segments, self.remote.rkey)
        except RdmaError as exc:
            self._error = str(exc)
            return
        self._posted.append(wr_id)

    async def _post_after(self, previous: concurrent.futures.Future | None, written: torch.cuda.Event,
                          segments: Segments) -> None:
        if previous is not None:
            await asyncio.wrap_future(previous)
        await asyncio.to_thread(written.synchronize)
        self._post(segments)

    async def _land(self) -> None:
        try:
            if self._last_deferred is not None:
                await asyncio.wrap_future(self._last_deferred)
            await asyncio.gather(*(self.connection.qp.finish(wr_id, self.timeout) for wr_id in self._posted))
        except Exception as exc:  # a failed write or a peer that went away: the request fails
            self._error = self._error or f"{type(exc).__name__}: {exc}"
        self.landed.set_result(self._error)


class KVDirectPusher:
    """Pushes over a KVDirectPuller's connections (one per peer, whichever way the KV moves)."""

    def __init__(self, puller: KVDirectPuller, pool: str, timeout: float):
        self.puller, self.pool, self.timeout = puller, pool, timeout

    async def push(self, address: str, remote_layers: Sequence[Sequence[int]]) -> LayerPush:
        """A push into the blocks `remote_layers` names at `address` (connecting first if need be)."""
        connection = await self.puller.connection(address)
        return LayerPush(connection, self.pool, remote_layers, asyncio.get_running_loop(), self.timeout)
