"""The engine's side of the KV hand-off over libs/rdma (KVDirect, docs/serving.md).

Every engine exposes its pools through a KVDirectServer: the device tier, and the cxl tier where
LayerKV may keep some layers of a prompt's KV. Pull mode: decode engines read a
prefill engine's held blocks one-sided and COMPLETE, which frees them. Push mode: a prefill engine
writes each layer's blocks one-sided into the blocks a decode engine reserved (libs/rdma/kvdirect's
KVDirectPusher). Both go through a KVDirectPuller's connections (CONNECT once per peer, descriptors,
coalescing), made on first use and dropped when the registry says the peer left.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import torch

from kvmesh.libs.messages.engine import KVHandle
from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import BlockReads, KVDirectPuller, TransferReport
from kvmesh.libs.rdma.kvdirect.pusher import KVDirectPusher, LayerPush
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer

POOL = "device"  # where pulled or pushed KV lands


class KVDataPlane:
    def __init__(self, backend: str, token: str, host: str, port: int, pools: dict[str, torch.Tensor],
                 release: Callable[[str], Awaitable[bool]], timeout: float = 10.0, options: dict | None = None):
        """`options` go to the backend's endpoints (verbs: device, gid_index, ib_port)."""
        self.backend = backend
        self.server = KVDirectServer(open_endpoint(backend, token, host, port, **(options or {})), release,
                                     timeout=timeout)
        for tier, tensor in pools.items():
            self.server.expose(tier, tensor)
        # Our own connections to peers leave from an endpoint of their own (an ephemeral port).
        self.puller = KVDirectPuller(open_endpoint(backend, token, host, 0, **(options or {})), timeout=timeout)
        self.puller.expose(POOL, pools[POOL])
        self.pusher = KVDirectPusher(self.puller, POOL, timeout)
        self.address = ""

    async def start(self) -> str:
        self.address = await self.server.start()
        await self.puller.endpoint.start()
        return self.address

    async def push_to(self, target: KVHandle) -> LayerPush:
        """A push of one request's KV into the blocks `target` names (connecting first if need be)."""
        return await self.pusher.push(target.data_address, target.layers)

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
