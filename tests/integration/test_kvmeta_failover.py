"""Redis failover by Sentinel under a running kvmeta (docs/deploy.md): a real master, a real replica
and three real Sentinels; the master is killed, the Sentinels promote the replica, and kvmeta
serves from it with no restart: 503s at most while it switches, never a 500. A worker kept
registered by WorkerPresence (what every engine runs) stays registered through it, heartbeating on
the promoted replica, and a watcher's stream comes back with a fresh snapshot and sees joins again."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis as redis_sync

from kvmesh.infra.local.processes import redis_address, sentinel_group
from kvmesh.libs.controlplane import RemoteError
from kvmesh.libs.kvmeta.client import WorkerPresence
from kvmesh.libs.kvmeta.messages import WorkerEvent

from ..conftest import start_kvmeta
from ..factories import worker_info

MASTER = "kvmesh-test"


@pytest.fixture
def replicated(tmp_path: Path):
    group = sentinel_group(tmp_path, MASTER)
    yield group
    group.stop()


async def test_kvmeta_follows_a_sentinel_failover_without_a_restart(replicated, tmp_path: Path):
    master, replica = replicated.master, replicated.replica
    replica_port = redis_address(replica.url)[1]
    kvmeta = start_kvmeta(tmp_path, "redis://127.0.0.1:1/0", "failover",
                          KVMESH_KVMETA_REDIS_SENTINELS=json.dumps(replicated.sentinels),
                          KVMESH_KVMETA_REDIS_MASTER=MASTER)
    events: list[WorkerEvent] = []

    async def watch() -> None:
        async with kvmeta.client() as watcher:
            async for event in watcher.watch():
                events.append(event)

    watching = asyncio.create_task(watch())
    try:
        async with kvmeta.client(retries=0) as client, \
                WorkerPresence(client, worker_info("engine-kept"), ttl_ms=1500):
            await client.register(worker_info("p0"))
            with redis_sync.Redis(port=replica_port) as r:  # replicated before the master goes
                deadline = time.monotonic() + 10
                while not r.keys("*") or not any(e.kind == "join" for e in events):
                    assert time.monotonic() < deadline, "the replica never synced"
                    await asyncio.sleep(0.1)
            started = time.monotonic()
            master.kill()
            statuses = []
            while True:
                try:
                    workers = await client.workers()
                    if replicated.master_port() == replica_port:
                        break
                except RemoteError as exc:
                    statuses.append(exc.status)
                assert time.monotonic() - started < 20, f"no failover in 20 s; statuses {statuses}"
                await asyncio.sleep(0.1)
            assert set(statuses) <= {503}
            print(f"failover: kvmeta served again {time.monotonic() - started:.1f} s after the master died")
            events_before = len(events)
            await client.register(worker_info("p1"))  # a write lands on the promoted replica
            assert "p1" in {w.info.id for w in await client.workers()}
            # the kept worker's registration may have run out while no master answered its heartbeats;
            # its next heartbeat is told so (404) and registers it again
            while "engine-kept" not in {w.info.id for w in await client.workers()}:
                assert time.monotonic() - started < 20, "the kept worker never came back"
                await asyncio.sleep(0.1)
            print(f"failover: the kept worker registered {time.monotonic() - started:.1f} s after the master died")

            # the watch stream broke with the master and came back with a fresh snapshot ...
            deadline = time.monotonic() + 10
            while not any(e.kind == "snapshot" for e in events[events_before:]):
                assert time.monotonic() < deadline, f"the watch did not come back; events: {events[events_before:]}"
                await asyncio.sleep(0.1)
            # ... and relays joins again
            await client.register(worker_info("p2"))
            while not any(e.kind == "join" and e.worker_id == "p2" for e in events):
                assert time.monotonic() < deadline, f"no join after the failover; events: {events[events_before:]}"
                await asyncio.sleep(0.1)

            # the kept worker heartbeats on the promoted replica: still there after two more TTLs
            await asyncio.sleep(3.0)
            kept = await client.worker("engine-kept")
            assert kept.info.id == "engine-kept"
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        kvmeta.child.stop()


def test_a_bad_sentinel_address_is_a_clear_error(tmp_path: Path):
    from kvmesh.libs.controlplane import ConfigError
    from kvmesh.services.kvmeta.connection import connect
    with pytest.raises(ConfigError, match="not host:port"):
        connect("redis://127.0.0.1:6379/0", ["nohostport"], MASTER, 1.0)
