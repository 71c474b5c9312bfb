"""Concurrent writers through several kvmeta processes leave every index matching its data."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from kvmesh.libs.controlplane import RemoteError

from ..conftest import Kvmeta, start_kvmeta
from ..factories import entries, lease, worker_info
from ..kvmeta_invariants import assert_consistent

ENGINES = [f"engine-{i}" for i in range(4)]
NODES = [f"node-{i}" for i in range(24)]


async def churn(kvmeta: Kvmeta, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    async with kvmeta.client() as client:
        for _ in range(rounds):
            engine = rng.choice(ENGINES)
            action = rng.random()
            try:
                if action < 0.08:
                    await client.register(worker_info(engine))  # a restart: purges what it held
                elif action < 0.12:
                    await client.deregister(engine)
                elif action < 0.45:
                    await client.publish(engine, entries(rng.sample(NODES, 6), tier=rng.choice(["device", "cxl"])))
                elif action < 0.65:
                    await client.evict(engine, rng.sample(NODES, 4))
                elif action < 0.8:
                    await client.lease_blocks(f"req-{rng.randrange(16)}", lease(engine))  # may move between engines
                elif action < 0.9:
                    await client.release_blocks(f"req-{rng.randrange(16)}")
                else:
                    await client.add_scores(engine, {n: 1.0 for n in rng.sample(NODES, 3)})
            except RemoteError as exc:
                assert exc.status == 404  # acting for an engine another writer just removed


async def test_concurrent_writers_keep_registry_cache_and_leases_consistent(kvmeta: Kvmeta, tmp_path: Path):
    second = start_kvmeta(tmp_path / "second", kvmeta.redis_url, kvmeta.cluster)
    try:
        async with kvmeta.client() as client:
            for engine in ENGINES:
                await client.register(worker_info(engine))
        await asyncio.gather(*(churn(service, seed, 150) for seed, service in enumerate([kvmeta, second] * 4)))
        with kvmeta.redis() as redis:
            assert_consistent(redis, kvmeta.prefix)
    finally:
        second.child.stop()
    async with kvmeta.client() as client:
        for engine in ENGINES:
            await client.deregister(engine)
        assert await client.lookup(NODES) == [] and await client.leases(expired=False) == []


async def test_one_leave_event_per_expiry_with_two_reapers(kvmeta: Kvmeta, tmp_path: Path):
    second = start_kvmeta(tmp_path / "second", kvmeta.redis_url, kvmeta.cluster)
    try:
        async with kvmeta.client() as client:
            events = client.watch()
            assert (await anext(events)).kind == "snapshot"
            for engine in ENGINES:
                await client.register(worker_info(engine), ttl_ms=150)
            await asyncio.sleep(1.0)  # all expire; both reapers run many times
            await client.register(worker_info("marker"))  # events are ordered: this one comes last
            seen = []
            async for event in events:
                if event.kind == "join" and event.worker_id == "marker":
                    break
                if event.kind == "leave":
                    seen.append(event.worker_id)
            await events.aclose()
            assert sorted(seen) == ENGINES
            await client.deregister("marker")
    finally:
        second.child.stop()
