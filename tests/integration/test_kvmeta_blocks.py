"""Block map: request -> engine, per-layer blocks, lease deadline; expired leases."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.libs.controlplane import RemoteError
from kvmesh.libs.kvmeta.client import KvmetaClient

from ..factories import lease, worker_info


async def test_lease_records_per_layer_blocks_until_released(client: KvmetaClient):
    await client.register(worker_info("p0"))
    record = await client.lease_blocks("req-1", lease("p0", layers=3))
    assert record.layers == [[0, 1], [2, 3], [4, 5]] and record.token_count == 20
    assert await client.blocks("req-1") == record
    assert await client.release_blocks("req-1") is True
    assert await client.release_blocks("req-1") is False
    with pytest.raises(RemoteError) as gone:
        await client.blocks("req-1")
    assert gone.value.status == 404


async def test_expired_leases_are_listed_per_engine_for_reclaiming(client: KvmetaClient):
    await client.register(worker_info("p0"))
    await client.register(worker_info("p1"))
    await client.lease_blocks("short-p0", lease("p0", lease_ms=100))
    await client.lease_blocks("long-p0", lease("p0", lease_ms=60_000))
    await client.lease_blocks("short-p1", lease("p1", lease_ms=100))
    await asyncio.sleep(0.25)
    assert [r.request_id for r in await client.leases("p0")] == ["short-p0"]
    assert sorted(r.request_id for r in await client.leases()) == ["short-p0", "short-p1"]
    assert sorted(r.request_id for r in await client.leases("p0", expired=False)) == ["long-p0", "short-p0"]
    assert len(await client.leases(limit=1)) == 1
    for rid in ("short-p0", "short-p1"):  # the engines reclaim and release
        await client.release_blocks(rid)
    assert await client.leases() == []


async def test_renewing_a_lease_moves_its_deadline(client: KvmetaClient):
    await client.register(worker_info("p0"))
    await client.lease_blocks("req-1", lease("p0", lease_ms=100))
    renewed = await client.lease_blocks("req-1", lease("p0", lease_ms=60_000))
    await asyncio.sleep(0.2)
    assert await client.leases("p0") == [] and (await client.blocks("req-1")).deadline_ms == renewed.deadline_ms


async def test_only_live_workers_may_hold_leases(client: KvmetaClient):
    with pytest.raises(RemoteError) as unknown:
        await client.lease_blocks("req-1", lease("ghost"))
    assert unknown.value.status == 404
