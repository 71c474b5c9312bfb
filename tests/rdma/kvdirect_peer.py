"""A prefill worker's data plane in its own process, for tests: a real engine KV pool (kv_pool.KVPool)
exposed through KVDirectServer; COMPLETE releases a request's blocks back to the pool.

    python -m tests.rdma.kvdirect_peer BACKEND TOKEN NUM_BLOCKS SEED

Prints {"address"} and then, for each stdin line {"prepare": [[request_id, n_blocks], ...]}, the
blocks it allocated ({"blocks": {request_id: [...]}}); after each release {"released", "free"}.
The pool holds seeded random bytes (`pool_pattern`), so a test can check every byte it pulls.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import torch

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer
from kvmesh.services.engine.kv_blocks import BlockShape
from kvmesh.services.engine.native.kv_pool import KVPool

SHAPE = BlockShape(block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)


def pool_pattern(num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim,
                       generator=generator).to(SHAPE.dtype)


def pool_path(pid: int) -> str:
    return f"/dev/shm/kvmesh-test-pool-{pid}"


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def serve(backend: str, token: str, num_blocks: int, seed: int) -> None:
    torch.set_num_threads(1)
    # File-backed, so the shm backend can map it; the test removes the file (this process may be killed).
    pool = KVPool("device", num_blocks, SHAPE, path=pool_path(os.getpid()))
    pool.tensor.copy_(pool_pattern(num_blocks, seed))
    held: dict[str, list[int]] = {}

    def release(request_id: str) -> bool:
        blocks = held.pop(request_id, None)
        if blocks is None:
            return False
        for block in blocks:
            if pool.decref(block) == 0:
                pool.release(block)
        say(released=request_id, free=pool.free_count)
        return True

    server = KVDirectServer(open_endpoint(backend, token), release)
    server.expose("device", pool.tensor)
    say(address=await server.start(), total=pool.num_blocks)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        blocks = {rid: pool.allocate(n) for rid, n in command["prepare"]}
        held.update(blocks)
        say(blocks=blocks)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
