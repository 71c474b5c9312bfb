"""A data-plane peer in its own process, for tests: it registers a pool filled with a known pattern
and then does nothing, so every byte a test reads from it is served one-sided.

    python -m tests.rdma.peer BACKEND TOKEN NBYTES SEED [shared|private]

prints one JSON line {"address", "region": [addr, length, rkey]} and runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.shm.shared import shared_buffer


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


async def serve(backend: str, token: str, nbytes: int, seed: int, memory: str) -> None:
    endpoint = open_endpoint(backend, token)
    address = await endpoint.start()
    pool = shared_buffer(nbytes) if memory == "shared" else np.zeros(nbytes, dtype=np.uint8)
    pool[:] = pattern(nbytes, seed)
    region = endpoint.register(pool)
    print(json.dumps({"address": address, "region": [region.addr, region.length, region.rkey]}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                      sys.argv[5] if len(sys.argv) > 5 else "shared"))
