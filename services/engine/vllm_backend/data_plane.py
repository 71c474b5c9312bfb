"""The connector's worker side of KVDirect, for a process whose own code is synchronous (vLLM's
worker): the endpoint, its server or puller, run on an event loop of their own thread.

A prefill instance serves its KV cache tensors, one per layer, to whoever CONNECTs, and hands each
COMPLETE to `on_complete`; a decode instance pulls blocks of those tensors into its own, one-sided,
and COMPLETEs. A vLLM layer's cache is a tensor whose first dimension is the block: a block's
bytes in every layer are what moves, whatever the attention backend lays out inside it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import torch

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import BlockReads, KVDirectPuller, TransferReport
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer


def block_dims(tensor: torch.Tensor) -> tuple[str, ...]:
    """Descriptor dimension names of a layer's cache: the block first (KVDirect's "B"), then the
    backend's own, named by position."""
    return ("B", *(f"d{i}" for i in range(1, tensor.dim())))


class LoopThread:
    """An asyncio loop on a daemon thread; `run` waits for a coroutine from any other thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return self.submit(coroutine).result(timeout)

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class KVServer:
    """A prefill instance's KV cache, served: `address` is where decode instances connect."""

    def __init__(self, caches: dict[str, torch.Tensor], backend: str, token: str, host: str, port: int,
                 on_complete: Callable[[str], Awaitable[bool]], timeout: float, options: dict | None = None):
        self.thread = LoopThread("kvmesh-kv-server")
        self.server = KVDirectServer(open_endpoint(backend, token, host, port, **(options or {})), on_complete,
                                     timeout=timeout)
        for name, tensor in caches.items():
            self.server.expose(name, tensor, block_dims(tensor))
        self.address = self.thread.run(self.server.start())

    def close(self) -> None:
        self.thread.run(self.server.close())
        self.thread.stop()


class KVPuller:
    """A decode instance's KV cache, where pulled blocks land."""

    def __init__(self, caches: dict[str, torch.Tensor], backend: str, token: str, host: str, timeout: float,
                 options: dict | None = None):
        self.thread = LoopThread("kvmesh-kv-puller")
        self.names = list(caches)
        self.puller = KVDirectPuller(open_endpoint(backend, token, host, 0, **(options or {})), timeout=timeout)
        for name, tensor in caches.items():
            self.puller.expose(name, tensor, block_dims(tensor))
        self.thread.run(self.puller.endpoint.start())
        self.timeout = timeout

    def start_pull(self, address: str, request_id: str, remote_blocks: list[int],
                   local_blocks: list[int]) -> Future[TransferReport]:
        """Start reading `remote_blocks` of every layer at `address` into our `local_blocks`, then
        COMPLETE (the prefill instance frees them); the future fails if the reads or the COMPLETE do."""
        reads = [BlockReads(name, name, remote_blocks, local_blocks) for name in self.names]
        return self.thread.submit(asyncio.wait_for(self.puller.pull(address, request_id, reads), self.timeout * 2))

    def close(self) -> None:
        self.thread.run(self.puller.close())
        self.thread.stop()
