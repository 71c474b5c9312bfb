"""KVDirect's push mode through the library alone: a pusher writes a request's layers, one at a time
from another thread and in chunks as steps compute them, into the blocks a server exposes; every byte
lands where the handle says, and a peer that went away fails the push instead of hanging it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import KVDirectPuller
from kvmesh.libs.rdma.kvdirect.pusher import KVDirectPusher
from kvmesh.libs.rdma.kvdirect.server import KVDirectServer
from kvmesh.libs.rdma.shm.shared import shared_tensor

from .conftest import TOKEN

POOL_SHAPE = (48, 2, 4, 2, 8)  # one pool, as the engine's: [B, KV, L, H, D]; a layer's blocks are ids in it
# Backends whose writes the owner's side lands (it stops at close); shm's writer copies into the
# owner's mapped file itself, so what it posts before the owner's BYE reaches it lands, close or not.
SERVED_BY_THE_OWNER = {"tcp", "verbs"}


async def nothing_to_release(request_id: str) -> bool:
    return False


@contextlib.asynccontextmanager
async def opened_pair(backend: str):
    """The decode side's pool behind a server (zeros), and a pusher over a pool holding a pattern
    (the prefill side's computed KV)."""
    target = shared_tensor(POOL_SHAPE, torch.bfloat16)
    source = shared_tensor(POOL_SHAPE, torch.bfloat16)
    source.copy_(torch.arange(source.numel(), dtype=torch.float32).view(POOL_SHAPE).to(torch.bfloat16))
    server = KVDirectServer(open_endpoint(backend, TOKEN), nothing_to_release, timeout=5.0)
    server.expose("device", target)
    address = await server.start()
    puller = KVDirectPuller(open_endpoint(backend, TOKEN), timeout=5.0)
    puller.expose("device", source)
    await puller.endpoint.start()
    try:
        yield server, address, KVDirectPusher(puller, "device", timeout=5.0), source, target
    finally:
        await puller.close()
        await server.close()


@pytest.fixture
async def pair(backend):
    async with opened_pair(backend) as opened:
        yield opened


async def test_each_layer_lands_in_the_blocks_reserved_for_it(pair):
    _, address, pusher, source, target = pair
    reserved = [[40, 41, 42], [5, 6, 30], [12, 13, 14]]   # the decode side's blocks, by layer
    computed = [[0, 1, 2], [3, 4, 9], [20, 21, 22]]      # where the prefill side wrote each layer
    push = await pusher.push(address, reserved)

    def forward_pass() -> None:  # the engine thread: layers as they finish, then no more writes
        for layer, blocks in enumerate(computed):
            push.layer_done(layer, 0, blocks)
        push.finish()

    await asyncio.to_thread(forward_pass)
    assert await asyncio.wrap_future(push.landed) is None
    for remote, local in zip(reserved, computed):
        assert torch.equal(target[remote], source[local])
    untouched = sorted(set(range(POOL_SHAPE[0])) - {b for layer in reserved for b in layer})
    assert not target[untouched].any()


async def test_a_peer_that_went_away_fails_the_push(pair):
    server, address, pusher, _, _ = pair
    push = await pusher.push(address, [[1, 2]])
    await server.close()

    def forward_pass() -> None:
        push.layer_done(0, 0, [3, 4])
        push.finish()

    await asyncio.to_thread(forward_pass)
    assert await asyncio.wait_for(asyncio.wrap_future(push.landed), 15) is not None


async def test_chunks_land_in_their_blocks_and_a_block_written_again_keeps_its_last_write(pair):
    """Two steps' chunks of one layer: the first fills block 0 and half of 1, the second writes 1
    (completed) again and 2; the reserved blocks end up as the last writes left them."""
    _, address, pusher, source, target = pair
    push = await pusher.push(address, [[30, 31, 32]])

    def two_steps() -> None:
        push.layer_done(0, 0, [7, 8])
        source[8].fill_(5.0)  # the second step completes block 1: its KV changes before its second write
        push.layer_done(0, 1, [8, 9])
        push.finish()

    await asyncio.to_thread(two_steps)
    assert await asyncio.wrap_future(push.landed) is None
    assert torch.equal(target[[30, 31, 32]], source[[7, 8, 9]])


async def test_closing_the_server_between_two_chunks_ends_the_push_with_an_error(backend):
    """The decode side goes away with the first chunk's writes in flight, right after CONNECT: its
    close returns and the push resolves; where the owner serves writes, with an error, the second
    chunk landing nowhere. A close that only cancelled its connections' tasks hung within these 30
    rounds in 4 runs of 6."""
    reserved = [[30, 31, 32, 33], [34, 35, 36, 37]]
    for _ in range(30):
        async with opened_pair(backend) as (server, address, pusher, _, target):
            push = await pusher.push(address, reserved)
            for layer in range(2):  # the first chunk, posted on this thread: nothing ran since CONNECT
                push.layer_done(layer, 0, [layer * 4, layer * 4 + 1])
            await asyncio.wait_for(server.close(), 15)
            for layer in range(2):
                push.layer_done(layer, 2, [layer * 4 + 2, layer * 4 + 3])
            push.finish()
            error = await asyncio.wait_for(asyncio.wrap_future(push.landed), 15)
            if backend in SERVED_BY_THE_OWNER:
                assert error is not None and not target[[32, 33, 36, 37]].any()
