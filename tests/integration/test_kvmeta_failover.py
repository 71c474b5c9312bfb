"""Redis failover by Sentinel under a running kvmeta (docs/deploy.md): a real master, a real replica
and three real Sentinels; the master is killed, the Sentinels promote the replica, and kvmeta
serves from it with no restart: 503s at most while it switches, never a 500. A worker kept
registered by WorkerPresence (what every engine runs) stays registered through it, heartbeating on
the promoted replica, and a watcher's stream comes back with a fresh snapshot and sees joins again."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import redis as redis_sync

from kvmesh.infra.local.processes import Child, free_port, redis_child
from kvmesh.libs.controlplane import RemoteError
from kvmesh.libs.kvmeta.client import WorkerPresence
from kvmesh.libs.kvmeta.messages import WorkerEvent

from ..conftest import start_kvmeta
from ..factories import worker_info

MASTER = "kvmesh-test"


def _sentinel(run_dir: Path, index: int, master_port: int) -> tuple[Child, int]:
    port = free_port()
    config = run_dir / f"sentinel-{index}.conf"
    config.write_text(f"port {port}\nbind 127.0.0.1\ndir {run_dir}\n"
                      f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n"
                      f"sentinel down-after-milliseconds {MASTER} 500\n"
                      f"sentinel failover-timeout {MASTER} 5000\n")
    child = Child(f"sentinel-{index}", [shutil.which("redis-server"), str(config), "--sentinel"],
                  run_dir / "logs" / f"sentinel-{index}.log", url=f"redis://127.0.0.1:{port}/0")
    child.start()
    return child, port


@pytest.fixture
def replicated(tmp_path: Path):
    master = redis_child(tmp_path / "master")
    master.start()
    master.wait_ready()
    master_port = int(master.url.rsplit(":", 1)[1].split("/")[0])
    replica = redis_child(tmp_path / "replica")
    replica.argv += ["--replicaof", "127.0.0.1", str(master_port)]
    replica.start()
    replica.wait_ready()
    sentinels = [_sentinel(tmp_path, i, master_port) for i in range(3)]
    yield master, replica, [port for _, port in sentinels]
    for child in [replica, master, *(c for c, _ in sentinels)]:
        child.stop()


def _master_port(sentinel_port: int) -> int:
    with redis_sync.Redis(port=sentinel_port) as sentinel:
        return int(sentinel.sentinel_get_master_addr_by_name(MASTER)[1])


async def test_kvmeta_follows_a_sentinel_failover_without_a_restart(replicated, tmp_path: Path):
    master, replica, sentinel_ports = replicated
    replica_port = int(replica.url.rsplit(":", 1)[1].split("/")[0])
    kvmeta = start_kvmeta(tmp_path, "redis://127.0.0.1:1/0", "failover",
                          KVMESH_KVMETA_REDIS_SENTINELS=str([f"127.0.0.1:{p}" for p in sentinel_ports]).replace("'", '"'),
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
                    if _master_port(sentinel_ports[0]) == replica_port:
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
