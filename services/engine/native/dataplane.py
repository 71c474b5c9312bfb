"""The engine's side of the KV hand-off over libs/rdma (KVDirect, docs/serving.md).

Every engine exposes its pools through a KVDirectServer: the device tier, and the cxl tier where
LayerKV may keep some layers of a prompt's KV. Pull mode: decode engines read a
prefill engine's held blocks one-sided and COMPLETE, which frees them. Push mode: a prefill engine
writes each layer's blocks one-sided into the blocks a decode engine reserved (KVPush). Both go
through a KVDirectPuller's connections (CONNECT once per peer, descriptors, coalescing), made on
first use and dropped when the registry says the peer left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import numpy as np
import torch

from kvmesh.libs.messages.engine import KVHandle
from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import BlockReads, KVDirectPuller, PullConnection, TransferReport
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer
from kvmesh.libs.rdma.work import RdmaError, Segments


log = logging.getLogger(__name__)

POOL = "device"  # where pulled or pushed KV lands


class KVDataPlane:
    def __init__(self, backend: str, token: str, host: str, port: int, role: str, pools: dict[str, torch.Tensor],
                 release: Callable[[str], Awaitable[bool]], timeout: float = 10.0, options: dict | None = None):
        """`options` go to the backend's endpoints (verbs: device, gid_index, ib_port)."""
        self.backend, self.role, self.timeout = backend, role, timeout
        self.server = KVDirectServer(open_endpoint(backend, token, host, port, **(options or {})), release,
                                     timeout=timeout)
        for tier, tensor in pools.items():
            self.server.expose(tier, tensor)
        # Our own connections to peers leave from an endpoint of their own (an ephemeral port).
        self.puller = KVDirectPuller(open_endpoint(backend, token, host, 0, **(options or {})), timeout=timeout)
        self.puller.expose(POOL, pools[POOL])
        self.address = ""

    async def start(self) -> str:
        self.address = await self.server.start()
        await self.puller.endpoint.start()
        return self.address

    async def push_to(self, target: KVHandle) -> KVPush:
        """A push of one request's KV into the blocks `target` names (connecting first if need be)."""
        connection = await self.puller.connection(target.data_address)
        return KVPush(connection, target, asyncio.get_running_loop(), self.timeout)

    async def pull(self, handle: KVHandle, local_layers: list[list[int]]) -> TransferReport:
        """Read the handle's blocks into our device tier, from whichever of the peer's tiers each
        layer is in, and COMPLETE (the prefill side frees them)."""
        tiers = handle.tiers or [POOL] * len(handle.layers)
        reads = []
        for tier in sorted(set(tiers)):
            layers = [i for i, t in enumerate(tiers) if t == tier]
            remote = np.concatenate([np.asarray(handle.layers[i][:len(local_layers[i])], dtype=np.int64) for i in layers])
            local = np.concatenate([np.asarray(local_layers[i], dtype=np.int64) for i in layers])
            reads.append(BlockReads(tier, POOL, remote, local))
        return await self.puller.pull(handle.data_address, handle.request_id, reads)

    async def forget(self, address: str) -> None:
        """A peer left: drop its connection (a new one is made if it comes back)."""
        await self.puller.disconnect(address)

    async def close(self) -> None:
        await self.server.close()
        await self.puller.close()


class KVPush:
    """Push mode: one request's prompt KV written into a decode engine's reserved blocks, a layer at
    a time from the engine thread while the forward pass goes on, then waited for before the first
    token is announced (the decode engine must find every byte in place)."""

    def __init__(self, connection: PullConnection, target: KVHandle, loop: asyncio.AbstractEventLoop, timeout: float):
        self.connection, self.target, self.loop, self.timeout = connection, target, loop, timeout
        self.remote = connection.remote[POOL]
        self.region, self.local = connection.local[POOL]
        self._posted: list[int] = []
        self._error: str | None = None

    def layer_done(self, layer: int, blocks: list[int]) -> None:
        """On the engine thread: this layer's KV is written; send it on (the post does not block)."""
        if self._error is not None:
            return
        if self.region.buffer.device.startswith("cuda"):
            torch.cuda.current_stream().synchronize()  # the NIC reads what the kernels wrote
        remote_offsets, size = self.remote.extents(np.asarray(self.target.layers[layer][:len(blocks)]))
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
        """On the engine thread: None once every write landed, else why not."""
        if self._error is None and self._posted:
            done = asyncio.run_coroutine_threadsafe(self._landed(), self.loop)
            try:
                done.result(self.timeout + 1)
            except Exception as exc:  # a failed write or a peer that went away: the request fails
                self._error = f"{type(exc).__name__}: {exc}"
        return self._error

    async def _landed(self) -> None:
        await asyncio.gather(*(self.connection.qp.finish(wr_id, self.timeout) for wr_id in self._posted))
