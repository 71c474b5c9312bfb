"""One behaviour for every data-plane backend: what a verbs RC queue pair does, the others do."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.endpoint import remote_segments
from kvmesh.libs.rdma.work import (ConnectRefused, LocalAccessError, Opcode, PeerUnreachable, QueuePairError, Segments,
                                   Status, TransferFailed)

from .conftest import TOKEN
from .peer import pattern

BLOCK = 4096


async def connected(owner, reader):
    qp = await reader.connect(owner.address)
    passive = await owner.accept(timeout=5)
    return qp, passive


def scattered(n: int, pool_blocks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(pool_blocks)[:n], rng.permutation(pool_blocks)[:n]


async def test_read_scattered_blocks_lands_every_byte(endpoints, buffer):
    owner, reader = endpoints
    src, dst = buffer(64 * BLOCK), buffer(64 * BLOCK)
    src[:] = pattern(src.nbytes, 1)
    remote, local = owner.register(src), reader.register(dst)
    qp, _ = await connected(owner, reader)
    src_blocks, dst_blocks = scattered(40, 64, 2)
    segments = remote_segments(dst_blocks * BLOCK, remote.remote(), src_blocks * BLOCK, np.full(40, BLOCK))

    completion = await qp.read(local, segments, remote.rkey, timeout=10)

    assert completion.ok and completion.opcode is Opcode.READ and completion.byte_len == 40 * BLOCK
    for s, d in zip(src_blocks, dst_blocks):
        assert np.array_equal(dst[d * BLOCK:(d + 1) * BLOCK], src[s * BLOCK:(s + 1) * BLOCK])
    untouched = np.setdiff1d(np.arange(64), dst_blocks)
    assert not dst.reshape(64, BLOCK)[untouched].any()


async def test_write_lands_in_the_peer_region(endpoints, buffer):
    owner, writer = endpoints
    target, data = buffer(8 * BLOCK), buffer(8 * BLOCK)
    data[:] = pattern(data.nbytes, 3)
    remote, local = owner.register(target), writer.register(data)
    qp, _ = await connected(owner, writer)

    await qp.write(local, remote_segments([0, 5 * BLOCK], remote.remote(), [7 * BLOCK, 100], [BLOCK, 3 * BLOCK]),
                   remote.rkey, timeout=10)

    assert np.array_equal(target[7 * BLOCK:8 * BLOCK], data[:BLOCK])
    assert np.array_equal(target[100:100 + 3 * BLOCK], data[5 * BLOCK:8 * BLOCK])
    assert not target[100 + 3 * BLOCK:7 * BLOCK].any()


async def test_send_and_recv_both_ways_in_order(endpoints, buffer):
    owner, other = endpoints
    a, b = buffer(4096), buffer(4096)
    ra, rb = owner.register(a), other.register(b)
    qp, passive = await connected(owner, other)
    b[:5], b[100:103] = list(b"hello"), list(b"bye")

    qp.post_send(1, rb, 0, 5)
    qp.post_send(2, rb, 100, 3)  # arrives before any receive is posted: held, not lost
    await asyncio.sleep(0.05)
    passive.post_recv(10, ra, 0, 64)
    passive.post_recv(11, ra, 64, 64)
    first, second = await passive.cq.wait(10, 5), await passive.cq.wait(11, 5)
    assert (first.byte_len, second.byte_len) == (5, 3)
    assert bytes(a[:5]) == b"hello" and bytes(a[64:67]) == b"bye"
    assert (await qp.cq.wait(1, 5)).ok and (await qp.cq.wait(2, 5)).ok

    qp.post_recv(20, rb, 200, 16)
    a[300:304] = list(b"ack!")
    passive.post_send(21, ra, 300, 4)
    assert (await qp.cq.wait(20, 5)).byte_len == 4 and bytes(b[200:204]) == b"ack!"


async def test_message_longer_than_the_receive_buffer_breaks_the_pair_on_both_sides(endpoints, buffer):
    owner, other = endpoints
    a, b = buffer(4096), buffer(4096)
    ra, rb = owner.register(a), other.register(b)
    qp, passive = await connected(owner, other)
    passive.post_recv(1, ra, 0, 8)
    qp.post_send(2, rb, 0, 100)
    assert (await passive.cq.wait(1, 5)).status is Status.LENGTH_ERROR
    await _until(lambda: not passive.usable and not qp.usable)
    with pytest.raises(QueuePairError):
        qp.post_send(3, rb, 0, 8)


@pytest.mark.parametrize("bad", ["wrong key", "past the end", "before the start", "deregistered"])
async def test_bad_remote_access_is_refused_counted_and_never_served(endpoints, buffer, bad):
    owner, reader = endpoints
    secret, dst = buffer(4 * BLOCK), buffer(4 * BLOCK)
    secret[:] = 7
    remote, local = owner.register(secret), reader.register(dst)
    good_qp, _ = await connected(owner, reader)
    bad_qp, _ = await connected(owner, reader)
    rkey, addr, length = remote.rkey, remote.addr, BLOCK
    if bad == "wrong key":
        rkey ^= 0x5A5A
    elif bad == "past the end":
        addr += 3 * BLOCK + 1
    elif bad == "before the start":
        addr -= 1
    else:
        owner.deregister(remote)

    with pytest.raises(TransferFailed) as failure:
        await bad_qp.read(local, Segments.one(0, addr, length), rkey, timeout=10)

    assert failure.value.completion.status is Status.REMOTE_ACCESS_ERROR
    await _until(lambda: owner.stats.refused_accesses == 1)  # shm reports it a moment later
    assert not dst.any()  # nothing served
    await _until(lambda: not bad_qp.usable)
    with pytest.raises(QueuePairError):
        bad_qp.post_read(99, local, Segments.one(0, remote.addr, 8), remote.rkey)
    if bad != "deregistered":  # good traffic on another connection carries on
        await good_qp.read(local, Segments.one(0, remote.addr, BLOCK), remote.rkey, timeout=10)
        assert (dst[:BLOCK] == 7).all()


async def test_wrong_token_is_refused_at_connect(backend, endpoints):
    owner, _ = endpoints
    intruder = open_endpoint(backend, "not-the-token")
    await intruder.start()
    try:
        with pytest.raises(ConnectRefused, match="token"):
            await intruder.connect(owner.address)
    finally:
        await intruder.close()
    assert owner.stats.refused_connects == 1


async def test_a_closed_endpoint_accepts_no_more_connections(endpoints):
    owner, reader = endpoints
    await owner.close()
    with pytest.raises(PeerUnreachable):
        await reader.connect(owner.address, timeout=5)
    assert not owner.queue_pairs


async def test_local_range_outside_the_region_is_refused_before_sending(endpoints, buffer):
    owner, reader = endpoints
    remote, local = owner.register(buffer(BLOCK)), reader.register(buffer(BLOCK))
    qp, _ = await connected(owner, reader)
    with pytest.raises(LocalAccessError):
        qp.post_read(1, local, Segments.one(BLOCK - 8, remote.addr, 16), remote.rkey)
    await qp.read(local, Segments.one(0, remote.addr, 16), remote.rkey, timeout=10)  # still usable
    assert owner.stats.refused_accesses == 0


async def test_many_outstanding_reads_complete(endpoints, buffer):
    owner, reader = endpoints
    src, dst = buffer(256 * BLOCK), buffer(256 * BLOCK)
    src[:] = pattern(src.nbytes, 4)
    remote, local = owner.register(src), reader.register(dst)
    qp, _ = await connected(owner, reader)
    for i in range(256):
        qp.post_read(i, local, Segments.one(i * BLOCK, remote.addr + (255 - i) * BLOCK, BLOCK), remote.rkey)
    done = [await qp.cq.wait(i, 10) for i in range(256)]
    assert all(c.ok for c in done)
    assert np.array_equal(dst.reshape(256, BLOCK), src.reshape(256, BLOCK)[::-1])


async def test_a_killed_peer_fails_transfers_within_a_timeout_and_a_new_one_serves(backend, endpoints, buffer,
                                                                                   peer_process):
    _, reader = endpoints
    nbytes = 8 << 20
    peer = peer_process(backend, nbytes, seed=5)
    dst = buffer(nbytes)
    local = reader.register(dst)
    qp = await reader.connect(peer.address)
    await qp.read(local, Segments.one(0, peer.region.addr, nbytes), peer.region.rkey, timeout=10)
    assert np.array_equal(dst, pattern(nbytes, 5))  # every byte, from another process

    peer.kill()
    killed = time.monotonic()
    with pytest.raises((TransferFailed, QueuePairError)):
        while True:  # a read may finish from the dying peer; the next ones must fail, never hang
            await qp.read(local, Segments.one(0, peer.region.addr, nbytes), peer.region.rkey, timeout=5)
    assert time.monotonic() - killed < 6

    fresh = peer_process(backend, nbytes, seed=6)
    qp = await reader.connect(fresh.address)
    await qp.read(local, Segments.one(0, fresh.region.addr, nbytes), fresh.region.rkey, timeout=10)
    assert np.array_equal(dst, pattern(nbytes, 6))
    # the dead peer's key on the new one (a handle from before a restart): refused, never served
    stale = await reader.connect(fresh.address)
    with pytest.raises(TransferFailed):
        await stale.read(local, Segments.one(0, fresh.region.addr, nbytes), peer.region.rkey, timeout=10)


@pytest.mark.parametrize("kill", ["posted", "landing"])
async def test_a_peer_killed_mid_read_ends_the_read_in_time(backend, endpoints, buffer, peer_process, kill):
    """The peer dies right after the read is posted, or once its first bytes are in (over TCP the
    rest then never comes). The read may finish (shm copies need no peer) or fail; it must not wait
    for its timeout."""
    _, reader = endpoints
    nbytes = 128 << 20
    peer = peer_process(backend, nbytes, seed=7)
    dst = buffer(nbytes)
    local = reader.register(dst)
    qp = await reader.connect(peer.address)
    wr_id = reader.next_wr_id()
    qp.post_read(wr_id, local, Segments.one(0, peer.region.addr, nbytes), peer.region.rkey)
    if kill == "landing":
        await _until(lambda: dst[:BLOCK].any(), poll_s=0.0005)
    peer.kill()
    killed = time.monotonic()
    try:
        await qp.finish(wr_id, timeout=10)
    except TransferFailed:
        pass
    assert time.monotonic() - killed < 3, "the read waited for its timeout"
    await _until(lambda: not qp.usable)


async def _until(predicate, timeout: float = 5.0, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(poll_s)
