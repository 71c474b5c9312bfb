"""One engine's end of KVDirect, whichever engine backend it is: the tensors it serves to peers, and
the tensors peers' KV lands in or leaves from (docs/dataplane.md).

    node = KVDirectNode("tcp", token, host, port, served={"device": pool}, landing={"device": pool},
                        release=free_blocks)
    address = await node.start()                        # where peers CONNECT, registered in kvmeta
    report = await node.pull(peer, "req-1", reads)      # pull mode: read a peer's blocks, then COMPLETE
    push = await node.push(peer, "device", layers)      # push mode: write ours into a peer's reservation

The server (on `port`) answers CONNECT with the served tensors' descriptors and each COMPLETE with
`release`; the puller leaves from an ephemeral port of its own, CONNECTs once per peer, and its
connections carry the pushes too. `ThreadedNode` runs a node for a caller whose own code is
synchronous (vLLM's worker), on an event loop of its own thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..backends import open_endpoint
from .descriptor import BLOCK_DIM
from .puller import BlockReads, KVDirectPuller, TransferReport
from .pusher import KVDirectPusher, LayerPush
from .server import KVDirectServer, ReleaseHook


def block_dims(tensor: torch.Tensor) -> tuple[str, ...]:
    """Descriptor dimension names of a KV tensor whose first dimension is the block: the rest are
    named by position (what moves is a block's bytes, whatever the layout inside it)."""
    return (BLOCK_DIM, *(f"d{i}" for i in range(1, tensor.dim())))


class KVDirectNode:
    def __init__(self, transport: str, token: str, host: str, port: int, *,
                 served: Mapping[str, torch.Tensor] | None = None, landing: Mapping[str, torch.Tensor] | None = None,
                 release: ReleaseHook | None = None, timeout: float = 10.0, options: dict | None = None):
        """`transport`: a libs/rdma backend (verbs, tcp, shm); `options` go to its endpoints (verbs:
        device, gid_index, ib_port). A node that serves nothing has no server, one with nothing
        landing no puller."""
        self.transport, self.timeout = transport, timeout
        self.server = self.puller = None
        if served:
            if release is None:
                raise ValueError("a node that serves KV needs `release`, the answer to a peer's COMPLETE")
            self.server = KVDirectServer(open_endpoint(transport, token, host, port, **(options or {})), release,
                                         timeout=timeout)
            for name, tensor in served.items():
                self.server.expose(name, tensor, block_dims(tensor))
        if landing:
            self.puller = KVDirectPuller(open_endpoint(transport, token, host, 0, **(options or {})), timeout=timeout)
            for name, tensor in landing.items():
                self.puller.expose(name, tensor, block_dims(tensor))
        self.address = ""

    async def start(self) -> str:
        """Listen; the served address ("" when nothing is served)."""
        if self.server is not None:
            self.address = await self.server.start()
        if self.puller is not None:
            await self.puller.endpoint.start()
        return self.address

    async def pull(self, address: str, request_id: str, reads: list[BlockReads]) -> TransferReport:
        """Read blocks of the peer at `address` into ours, then COMPLETE (the peer frees them)."""
        return await self.puller.pull(address, request_id, reads)

    async def push(self, address: str, pool: str, remote_layers: Sequence[Sequence[int]]) -> LayerPush:
        """A push of blocks of our `pool` into those `remote_layers` names at `address`."""
        return await KVDirectPusher(self.puller, pool, self.timeout).push(address, remote_layers)

    async def forget(self, address: str) -> None:
        """A peer left: drop its connection (a new one is made if it comes back)."""
        if self.puller is not None:
            await self.puller.disconnect(address)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        if self.puller is not None:
            await self.puller.close()


class ThreadedNode:
    """A KVDirectNode on an asyncio loop of a daemon thread, for synchronous callers: the server's
    `release` and the pulls run on that thread."""

    def __init__(self, node: KVDirectNode, name: str = "kvmesh-kvdirect"):
        self.node = node
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.address = self._run(node.start())

    def pull(self, address: str, request_id: str, reads: list[BlockReads]) -> Future[TransferReport]:
        """Start a pull; the future fails if the reads or the COMPLETE do, or they take over twice the timeout."""
        return self._submit(asyncio.wait_for(self.node.pull(address, request_id, reads), self.node.timeout * 2))

    def close(self) -> None:
        self._run(self.node.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return self._submit(coroutine).result()

    def _submit(self, coroutine: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)
