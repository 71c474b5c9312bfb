"""Worker registry: register, heartbeat with TTL, list, watch join/leave events."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.libs.controlplane import RemoteError
from kvmesh.libs.kvmeta.client import KvmetaClient, WorkerPresence
from kvmesh.libs.kvmeta.messages import Load, WorkerEvent

from ..factories import entries, lease, worker_info


async def next_event(events, kind: str, timeout: float = 5.0) -> WorkerEvent:
    async def wait() -> WorkerEvent:
        async for event in events:
            if event.kind == kind:
                return event
        raise AssertionError("watch stream ended")

    return await asyncio.wait_for(wait(), timeout)


async def test_registered_worker_is_listed_with_its_metadata(client: KvmetaClient):
    info = worker_info("prefill-0")
    worker = await client.register(info, ttl_ms=5_000)
    assert worker.info == info and worker.deadline_ms == worker.registered_ms + 5_000
    assert [w.info for w in await client.workers()] == [info]
    assert (await client.worker("prefill-0")).info.pairing[1].nic == "mlx5_1"


async def test_heartbeat_records_load_and_keeps_worker_alive(client: KvmetaClient):
    await client.register(worker_info("decode-0", role="decode"), ttl_ms=400)
    load = Load(free_blocks={"device": 100, "cxl": 7}, waiting=3, running=2)
    for _ in range(6):
        await asyncio.sleep(0.15)
        ack = await client.heartbeat("decode-0", load)
        assert ack.deadline_ms == ack.heartbeat_ms + 400
    worker = await client.worker("decode-0")
    assert worker.load == load and worker.heartbeat_ms > worker.registered_ms


async def test_worker_without_heartbeat_expires_on_its_own(client: KvmetaClient):
    await client.register(worker_info("prefill-0"), ttl_ms=200)
    await asyncio.sleep(0.5)
    assert await client.workers() == []
    with pytest.raises(RemoteError) as missing:
        await client.heartbeat("prefill-0")
    assert missing.value.status == 404


async def test_watch_starts_with_snapshot_then_streams_join_and_leave(client: KvmetaClient):
    await client.register(worker_info("prefill-0"), ttl_ms=5_000)
    events = client.watch()
    snapshot = await next_event(events, "snapshot")
    assert [w.info.id for w in snapshot.workers] == ["prefill-0"]

    await client.register(worker_info("decode-0", role="decode"), ttl_ms=200)
    join = await next_event(events, "join")
    assert join.worker_id == "decode-0" and join.worker.role == "decode"

    leave = await next_event(events, "leave")  # decode-0 sends no heartbeat
    assert (leave.worker_id, leave.reason) == ("decode-0", "expired")

    await client.deregister("prefill-0")
    leave = await next_event(events, "leave")
    assert (leave.worker_id, leave.reason) == ("prefill-0", "deregistered")
    await events.aclose()


async def test_departed_worker_takes_its_cache_entries_and_leases_with_it(client: KvmetaClient):
    await client.register(worker_info("prefill-0"), ttl_ms=5_000)
    await client.register(worker_info("prefill-1"), ttl_ms=200)
    for engine in ("prefill-0", "prefill-1"):
        await client.publish(engine, entries(["a", "b"]))
        await client.lease_blocks(f"req-{engine}", lease(engine))
    await asyncio.sleep(0.5)  # prefill-1 expires
    assert [(m.engine, m.blocks) for m in await client.lookup(["a", "b"])] == [("prefill-0", 2)]
    assert [r.request_id for r in await client.leases(expired=False)] == ["req-prefill-0"]

    await client.deregister("prefill-0")
    assert await client.lookup(["a", "b"]) == []
    assert await client.leases(expired=False) == []


async def test_registering_again_is_a_restart_that_drops_the_old_state(client: KvmetaClient):
    await client.register(worker_info("prefill-0"))
    await client.publish("prefill-0", entries(["a"]))
    await client.lease_blocks("req-1", lease("prefill-0"))
    events = client.watch()
    await next_event(events, "snapshot")

    await client.register(worker_info("prefill-0"))
    leave = await next_event(events, "leave")
    assert leave.reason == "reregistered"
    assert (await next_event(events, "join")).worker_id == "prefill-0"
    assert await client.lookup(["a"]) == []
    with pytest.raises(RemoteError) as gone:
        await client.blocks("req-1")
    assert gone.value.status == 404
    await events.aclose()


async def test_presence_heartbeats_and_deregisters_on_exit(client: KvmetaClient):
    load = Load(free_blocks={"device": 5})
    async with WorkerPresence(client, worker_info("decode-0", role="decode"), ttl_ms=300, load=lambda: load):
        await asyncio.sleep(0.8)  # well past the TTL: only heartbeats keep it
        worker = await client.worker("decode-0")
        assert worker.load == load
    assert await client.workers() == []


async def test_presence_registers_again_when_kvmeta_forgot_the_worker(client: KvmetaClient):
    registrations = []
    async with WorkerPresence(client, worker_info("decode-0", role="decode"), ttl_ms=300,
                              on_register=lambda: registrations.append(1)):
        await client.deregister("decode-0")  # as if Redis lost its data
        await asyncio.sleep(0.5)
        assert [w.info.id for w in await client.workers()] == ["decode-0"]
    assert len(registrations) == 2
