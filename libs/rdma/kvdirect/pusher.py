"""KVDirect's push mode (KVDirect Fig. 10, the baseline to its pull): the side that computes the KV
writes it one-sided into blocks the other side reserved, a layer at a time while its forward pass
goes on, over a connection a KVDirectPuller made (CONNECT once per peer, the peer's descriptors).

`KVDirectPusher.push` starts one request's push; the returned `LayerPush` takes each layer as it is
written (`layer_done`, from the computing thread; the post does not block) and `wait` returns once
every write landed, before the first token is announced: the reader must find every byte in place.
"""

from __future__ import annotations

import asyncio
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
        self._posted: list[int] = []
        self._error: str | None = None

    def layer_done(self, layer: int, blocks: list[int]) -> None:
        """On the computing thread: this layer's KV is in `blocks` of the local pool; write it out."""
        if self._error is not None:
            return
        if self.region.buffer.device.startswith("cuda"):
            torch.cuda.current_stream().synchronize()  # the NIC reads what the kernels wrote
        remote_offsets, size = self.remote.extents(np.asarray(self.remote_layers[layer][:len(blocks)]))
        local_offsets, _ = self.local.extents(np.asarray(blocks))
        segments = Segments(local_offsets, self.remote.addr + remote_offsets,
                            np.full(len(local_offsets), size, dtype=np.int64)).coalesced()
        wr_id = self.connection.qp.endpoint.next_wr_id()
        try:
            self.connection.qp.post_write(wr_id, self.region, segments, self.remote.rkey)
        except RdmaError as exc:
            self._error = str(exc)
            return
        self._posted.append(wr_id)

    def wait(self) -> str | None:
        """On the computing thread: None once every write landed, else why not."""
        if self._error is None and self._posted:
            done = asyncio.run_coroutine_threadsafe(self._landed(), self.loop)
            try:
                done.result(self.timeout + 1)
            except Exception as exc:  # a failed write or a peer that went away: the request fails
                self._error = f"{type(exc).__name__}: {exc}"
        return self._error

    async def _landed(self) -> None:
        await asyncio.gather(*(self.connection.qp.finish(wr_id, self.timeout) for wr_id in self._posted))


class KVDirectPusher:
    """Pushes over a KVDirectPuller's connections (one per peer, whichever way the KV moves)."""

    def __init__(self, puller: KVDirectPuller, pool: str, timeout: float):
        self.puller, self.pool, self.timeout = puller, pool, timeout

    async def push(self, address: str, remote_layers: Sequence[Sequence[int]]) -> LayerPush:
        """A push into the blocks `remote_layers` names at `address` (connecting first if need be)."""
        connection = await self.puller.connection(address)
        return LayerPush(connection, self.pool, remote_layers, asyncio.get_running_loop(), self.timeout)
