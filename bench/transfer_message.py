"""The message-passing baseline of KVDirect Fig. 3 / Fig. 7(a), over the same data-plane backend.

Per round the decode side SENDs the ids of the blocks it wants next; the prefill side gathers those
blocks into its communication buffer and SENDs the buffer; the decode side receives it into its own
buffer and scatters the blocks into its pool. After the last round it notifies the prefill side
and waits for the acknowledgement. `blocks_per_message` = 1 is Fig. 3's per-block protocol; larger
values are Fig. 7(a)'s buffer of several blocks. Gather and scatter use numpy's fancy indexing (the
fastest scattered copy measured here). It is a benchmark baseline, not part of the library.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
import numpy as np

from kvmesh.libs.rdma.endpoint import Endpoint, QueuePair
from kvmesh.libs.rdma.shm.shared import shared_buffer
from kvmesh.libs.rdma.work import RdmaError

log = logging.getLogger(__name__)

CONTROL_BYTES = 64 << 10
TIMEOUT_S = 30.0


class _Buffers:
    """One side's registered memory: a receive slot for control messages, a send slot, and the
    communication buffer that carries blocks."""

    def __init__(self, endpoint: Endpoint, buffer_bytes: int):
        self.memory = shared_buffer(2 * CONTROL_BYTES + buffer_bytes)
        self.region = endpoint.register(self.memory)
        self.comm = self.memory[2 * CONTROL_BYTES:]

    async def send(self, qp: QueuePair, message: dict) -> None:
        payload = msgpack.packb(message)
        self.memory[CONTROL_BYTES:CONTROL_BYTES + len(payload)] = np.frombuffer(payload, np.uint8)
        wr_id = qp.endpoint.next_wr_id()
        qp.post_send(wr_id, self.region, CONTROL_BYTES, len(payload))
        await qp.finish(wr_id, TIMEOUT_S)

    def post_control_recv(self, qp: QueuePair) -> int:
        wr_id = qp.endpoint.next_wr_id()
        qp.post_recv(wr_id, self.region, 0, CONTROL_BYTES)
        return wr_id

    async def recv_control(self, qp: QueuePair, wr_id: int) -> dict:
        completion = await qp.finish(wr_id, TIMEOUT_S)
        return msgpack.unpackb(self.memory[:completion.byte_len].tobytes())


async def serve(endpoint: Endpoint, pools: dict[str, np.ndarray], buffer_bytes: int) -> None:
    """The prefill side: answer every connection's block requests until it closes."""
    while True:
        qp = await endpoint.accept()
        asyncio.ensure_future(_serve_one(qp, _Buffers(endpoint, buffer_bytes), pools))


async def _serve_one(qp: QueuePair, buffers: _Buffers, pools: dict[str, np.ndarray]) -> None:
    try:
        while True:
            request = await buffers.recv_control(qp, buffers.post_control_recv(qp))
            if "done" in request:
                await buffers.send(qp, {"ack": request["done"]})
                continue
            pool = pools[request["pool"]]
            ids = np.asarray(request["blocks"], dtype=np.int64)
            block_bytes = pool.shape[1]
            staged = buffers.comm[:len(ids) * block_bytes].reshape(len(ids), block_bytes)
            np.take(pool, ids, axis=0, out=staged)  # gather
            wr_id = qp.endpoint.next_wr_id()
            qp.post_send(wr_id, buffers.region, 2 * CONTROL_BYTES, staged.nbytes)
            await qp.finish(wr_id, TIMEOUT_S)
    except RdmaError as exc:  # the decode side went away
        log.debug("message server: connection from %s ends: %s", qp.peer, exc)
        await qp.close()


class MessageClient:
    """The decode side: pulls blocks round by round through the communication buffer."""

    def __init__(self, endpoint: Endpoint, buffer_bytes: int):
        self.endpoint = endpoint
        self.buffers = _Buffers(endpoint, buffer_bytes)
        self.qp: QueuePair | None = None

    async def connect(self, address: str) -> None:
        self.qp = await self.endpoint.connect(address)

    async def transfer(self, request_id: str, pool_name: str, remote_blocks: np.ndarray, local_pool: np.ndarray,
                       local_blocks: np.ndarray, blocks_per_message: int) -> None:
        qp, block_bytes = self.qp, local_pool.shape[1]
        for start in range(0, len(remote_blocks), blocks_per_message):
            ids = remote_blocks[start:start + blocks_per_message]
            data_wr = qp.endpoint.next_wr_id()
            qp.post_recv(data_wr, self.buffers.region, 2 * CONTROL_BYTES, len(ids) * block_bytes)
            await self.buffers.send(qp, {"pool": pool_name, "blocks": ids.tolist()})  # block ids out
            await qp.finish(data_wr, TIMEOUT_S)  # blocks in
            received = self.buffers.comm[:len(ids) * block_bytes].reshape(len(ids), block_bytes)
            local_pool[local_blocks[start:start + len(ids)]] = received  # scatter
        ack_wr = self.buffers.post_control_recv(qp)
        await self.buffers.send(qp, {"done": request_id})  # notify
        await self.buffers.recv_control(qp, ack_wr)
