"""Redis killed and restarted under a running kvmeta: 503 with a clear message, then recovery."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kvmesh.infra.local.processes import Child
from kvmesh.libs.controlplane import RemoteError

from ..conftest import start_kvmeta
from ..factories import worker_info
from ..polling import eventually


async def test_kvmeta_answers_503_while_redis_is_down_and_recovers_by_itself(own_redis: Child, tmp_path: Path):
    kvmeta = start_kvmeta(tmp_path, own_redis.url, "outage")
    try:
        async with kvmeta.client(retries=0) as client, aiohttp.ClientSession() as http:
            await client.register(worker_info("p0"))
            watch = client.watch(retry_delay=0.1)
            assert (await anext(watch)).kind == "snapshot"

            own_redis.kill()
            with pytest.raises(RemoteError) as down:
                await client.workers()
            assert down.value.status == 503 and "Redis" in down.value.message and "unreachable" in down.value.message
            async with http.get(kvmeta.url + "/health") as health, http.get(kvmeta.url + "/ready") as ready:
                assert health.status == 200 and ready.status == 503

            own_redis.start()  # same port, empty data: as after a failover without persistence
            own_redis.wait_ready()
            await eventually(lambda: client.register(worker_info("p1")), retry=(RemoteError, AssertionError))
            assert [w.info.id for w in await client.workers()] == ["p1"]

            # The watch stream broke with Redis; the client reconnected and resynchronised: p1 shows
            # up in the fresh snapshot, or joins right after it.
            snapshot = await asyncio.wait_for(anext(watch), 10)
            assert snapshot.kind == "snapshot"
            if [w.info.id for w in snapshot.workers] != ["p1"]:
                join = await asyncio.wait_for(anext(watch), 10)
                assert (join.kind, join.worker_id) == ("join", "p1")
            await watch.aclose()
            async with http.get(kvmeta.url + "/ready") as ready:
                assert ready.status == 200
            await client.deregister("p1")
    finally:
        kvmeta.child.stop()
    assert kvmeta.child.exited() == 0 or kvmeta.child.exited() == -15
