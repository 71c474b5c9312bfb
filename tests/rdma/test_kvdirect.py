"""KVDirect end to end between two real processes: a prefill worker's engine KV pool served through
KVDirectServer, pulled by this process with KVDirectPuller, over every available backend."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.kvdirect.puller import BlockReads, KVDirectPuller, PeerRefused
from kvmesh.libs.rdma.shm.shared import shared_tensor
from kvmesh.libs.rdma.work import ConnectRefused, RdmaError, Segments, TransferFailed

from .conftest import ROOT, TOKEN
from .kvdirect_peer import SHAPE, pool_path, pool_pattern

PREFILL_BLOCKS = 256
DECODE_BLOCKS = 256


class PrefillProcess:
    def __init__(self, backend: str, seed: int):
        self.seed = seed
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.rdma.kvdirect_peer", backend, TOKEN,
                                      str(PREFILL_BLOCKS), str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
        self.released: list[dict] = []  # release lines read while looking for something else
        hello = self._next()
        self.address, self.total = hello["address"], hello["total"]
        self.pattern = pool_pattern(PREFILL_BLOCKS, seed)

    def _next(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill process exited with {self.proc.wait(5)}")
        return json.loads(line)

    def prepare(self, **requests: int) -> dict[str, list[int]]:
        self.proc.stdin.write(json.dumps({"prepare": list(requests.items())}) + "\n")
        self.proc.stdin.flush()
        while "blocks" not in (event := self._next()):
            self.released.append(event)
        return event["blocks"]

    def releases(self, n: int) -> list[dict]:
        while len(self.released) < n:
            self.released.append(self._next())
        taken, self.released = self.released[:n], self.released[n:]
        return taken

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        if os.path.exists(pool_path(self.proc.pid)):
            os.unlink(pool_path(self.proc.pid))


@pytest.fixture
def prefill(backend):
    started: list[PrefillProcess] = []

    def start(seed: int = 0) -> PrefillProcess:
        started.append(PrefillProcess(backend, seed))
        return started[-1]

    yield start
    for process in started:
        process.stop()


@pytest.fixture
async def puller(backend):
    puller = KVDirectPuller(open_endpoint(backend, TOKEN), timeout=3.0)
    await puller.endpoint.start()
    pool = shared_tensor((DECODE_BLOCKS, 2, SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim), SHAPE.dtype)
    puller.expose("device", pool)
    puller.pool = pool
    yield puller
    await puller.close()


def assert_pulled(puller, prefill: PrefillProcess, remote: list[int], local: list[int]) -> None:
    assert torch.equal(puller.pool[local].view(torch.int16), prefill.pattern[remote].view(torch.int16))


async def test_pull_a_request_from_another_process_lands_every_byte_and_releases(puller, prefill):
    peer = prefill(seed=1)
    remote = peer.prepare(r1=48)["r1"]
    local = list(range(100, 148))

    report = await puller.pull(peer.address, "r1", [BlockReads("device", "device", remote, local)])

    assert_pulled(puller, peer, remote, local)
    assert report.pieces == 48 and report.bytes == 48 * SHAPE.bytes
    assert 1 <= report.reads_posted < 48  # a fresh pool hands out runs, and runs coalesce
    assert peer.releases(1) == [{"released": "r1", "free": peer.total}]


async def test_concurrent_requests_share_coalesced_batches_and_all_complete(puller, prefill):
    peer = prefill(seed=2)
    blocks = peer.prepare(**{f"r{i}": 6 + i for i in range(8)})
    rng = np.random.default_rng(0)
    local = rng.permutation(DECODE_BLOCKS)
    starts = np.cumsum([0] + [len(b) for b in blocks.values()])
    dests = {rid: local[starts[i]:starts[i + 1]].tolist() for i, rid in enumerate(blocks)}

    reports = await asyncio.gather(*(puller.pull(peer.address, rid, [BlockReads("device", "device", b, dests[rid])])
                                     for rid, b in blocks.items()))

    for rid, b in blocks.items():
        assert_pulled(puller, peer, b, dests[rid])
    assert [r.request_id for r in reports] == list(blocks)
    released = peer.releases(8)
    assert {e["released"] for e in released} == set(blocks) and released[-1]["free"] == peer.total


async def test_without_coalescing_every_piece_is_its_own_read(backend, prefill):
    peer = prefill(seed=3)
    puller = KVDirectPuller(open_endpoint(backend, TOKEN), coalescing=False, timeout=3.0)
    await puller.endpoint.start()
    pool = shared_tensor((DECODE_BLOCKS, 2, SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim), SHAPE.dtype)
    puller.expose("device", pool)
    try:
        remote = peer.prepare(r=32)["r"]
        report = await puller.pull(peer.address, "r", [BlockReads("device", "device", remote, list(range(32)))])
        assert report.reads_posted == report.pieces == 32
        assert torch.equal(pool[:32].view(torch.int16), peer.pattern[remote].view(torch.int16))
    finally:
        await puller.close()


async def test_bad_transfers_are_refused_before_anything_is_posted(puller, prefill):
    peer = prefill(seed=4)
    remote = peer.prepare(r=4)["r"]
    connection = await puller.connection(peer.address)
    with pytest.raises(KeyError, match="exposes no tensor"):
        connection.transfer("r", BlockReads("cxl", "device", remote, [0, 1, 2, 3]))
    with pytest.raises(KeyError, match="no local tensor"):
        connection.transfer("r", BlockReads("device", "cxl", remote, [0, 1, 2, 3]))
    with pytest.raises(IndexError):
        connection.transfer("r", BlockReads("device", "device", [PREFILL_BLOCKS], [0]))
    with pytest.raises(ValueError, match="differ in length"):
        connection.transfer("r", BlockReads("device", "device", remote, [0, 1]))
    with pytest.raises(PeerRefused, match="did not release"):
        await puller.pull(peer.address, "never-prepared", [])
    report = await puller.pull(peer.address, "r", [BlockReads("device", "device", remote, [0, 1, 2, 3])])
    assert report.pieces == 4 and connection.usable
    assert peer.releases(1)[0]["free"] == peer.total


async def test_wrong_token_cannot_connect(backend, prefill):
    peer = prefill(seed=5)
    intruder = KVDirectPuller(open_endpoint(backend, "forged"), timeout=3.0)
    try:
        with pytest.raises(ConnectRefused, match="token"):
            await intruder.connection(peer.address)
    finally:
        await intruder.close()


async def test_forged_reads_are_refused_while_good_pulls_go_on(backend, puller, prefill):
    peer = prefill(seed=6)
    remote = peer.prepare(good=64)["good"]
    rogue = KVDirectPuller(open_endpoint(backend, TOKEN), timeout=3.0)
    try:
        rogue_pool = shared_tensor((4, 2, SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim), SHAPE.dtype)
        rogue.expose("device", rogue_pool)
        bad = await rogue.connection(peer.address)
        desc, (region, _) = bad.remote["device"], rogue.local["device"]
        good = asyncio.ensure_future(puller.pull(peer.address, "good", [BlockReads("device", "device", remote, list(range(64)))]))
        with pytest.raises(TransferFailed):  # past the end of the prefill pool
            await bad.qp.read(region, Segments.one(0, desc.addr + PREFILL_BLOCKS * SHAPE.bytes, SHAPE.bytes), desc.rkey, timeout=3)
        assert not rogue_pool.view(torch.int16).any()
        await good
        assert_pulled(puller, peer, remote, list(range(64)))
    finally:
        await rogue.close()


async def test_killed_prefill_fails_the_transfer_in_time_and_a_new_worker_serves(puller, prefill):
    peer = prefill(seed=7)
    remote = peer.prepare(r=64)["r"]
    await puller.connection(peer.address)
    peer.proc.kill()
    peer.proc.wait(10)
    started = time.monotonic()
    with pytest.raises(RdmaError):
        await puller.pull(peer.address, "r", [BlockReads("device", "device", remote, list(range(64)))])
    assert time.monotonic() - started < puller.timeout + 2

    fresh = prefill(seed=8)
    remote = fresh.prepare(r=64)["r"]
    await puller.pull(fresh.address, "r", [BlockReads("device", "device", remote, list(range(64)))])
    assert_pulled(puller, fresh, remote, list(range(64)))


async def test_a_connection_cut_before_its_reads_are_posted_fails_the_pull_at_once_then_reconnects(puller, prefill):
    """The queue pair breaks between the pull taking its connection and the reads being posted (a cut
    connection, as the chaos bench makes): the pull fails at once, never waits forever for its COMPLETE,
    and the next pull reconnects and lands every byte."""
    peer = prefill(seed=11)
    remote = peer.prepare(r=32)["r"]
    reads = [BlockReads("device", "device", remote, list(range(32)))]
    connection = await puller.connection(peer.address)
    # runs once the pull below has queued its reads and COMPLETE, before they are posted
    asyncio.get_running_loop().call_soon(connection.qp.fail, "cut by the test")
    with pytest.raises(RdmaError, match="cut by the test"):
        async with asyncio.timeout(5):  # no task of its own: the pull queues everything before the cut
            await puller.pull(peer.address, "r", reads)
    await puller.pull(peer.address, "r", reads)
    assert_pulled(puller, peer, remote, list(range(32)))


async def test_frozen_prefill_fails_the_transfer_within_the_timeout_then_reconnects(puller, prefill):
    peer = prefill(seed=9)
    remote = peer.prepare(a=16, b=16)
    await puller.pull(peer.address, "a", [BlockReads("device", "device", remote["a"], list(range(16)))])
    peer.proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RdmaError):
        await puller.pull(peer.address, "b", [BlockReads("device", "device", remote["b"], list(range(16)))])
    assert time.monotonic() - started < puller.timeout + 2
    peer.proc.send_signal(signal.SIGCONT)
    # Whether b's COMPLETE reached the prefill side is unknown to us (shm copies need no peer, so it
    # may have been sent); its blocks are the prefill side's lease to expire. The next use reconnects.
    c = peer.prepare(c=16)["c"]
    await puller.pull(peer.address, "c", [BlockReads("device", "device", c, list(range(16, 32)))])
    assert_pulled(puller, peer, c, list(range(16, 32)))
