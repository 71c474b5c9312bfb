"""The engine's side of the KV hand-off over libs/rdma (KVDirect, docs/serving.md).

A prefill engine exposes its device pool through a KVDirectServer: decode engines read the held
blocks one-sided and COMPLETE, which frees them. A decode engine pulls through a KVDirectPuller
into blocks its scheduler gave the request, connecting to each prefill engine on first use and
dropping the connection when the registry says that engine left. A `both` engine does either.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import numpy as np
import torch

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import BlockReads, KVDirectPuller, TransferReport
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer

from .handoff import KVHandle

log = logging.getLogger(__name__)

POOL = "device"


class KVDataPlane:
    def __init__(self, backend: str, token: str, host: str, port: int, role: str, pool: torch.Tensor,
                 release: Callable[[str], Awaitable[bool]], timeout: float = 10.0):
        self.role = role
        self.server = self.puller = None
        if role in ("prefill", "both"):
            self.server = KVDirectServer(open_endpoint(backend, token, host, port), release, timeout=timeout)
            self.server.expose(POOL, pool)
        if role in ("decode", "both"):
            # A decode-only engine listens on an ephemeral port: nobody connects to it.
            self.puller = KVDirectPuller(open_endpoint(backend, token, host, 0 if self.server else port), timeout=timeout)
            self.puller.expose(POOL, pool)
        self.address = ""

    async def start(self) -> str:
        if self.server is not None:
            self.address = await self.server.start()
        if self.puller is not None:
            puller_address = await self.puller.endpoint.start()
            self.address = self.address or puller_address
        return self.address

    async def pull(self, handle: KVHandle, local_layers: list[list[int]]) -> TransferReport:
        """Read the handle's blocks into ours, layer by layer, and COMPLETE (the prefill side frees them)."""
        if self.puller is None:
            raise RuntimeError("this engine has no decode role: it does not pull KV")
        remote = np.concatenate([np.asarray(blocks[:len(local)], dtype=np.int64)
                                 for blocks, local in zip(handle.layers, local_layers)])
        local = np.concatenate([np.asarray(blocks, dtype=np.int64) for blocks in local_layers])
        return await self.puller.pull(handle.data_address, handle.request_id, [BlockReads(POOL, POOL, remote, local)])

    async def forget(self, address: str) -> None:
        """A prefill engine left: drop its connection (a new one is made if it comes back)."""
        if self.puller is not None:
            await self.puller.disconnect(address)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        if self.puller is not None:
            await self.puller.close()
