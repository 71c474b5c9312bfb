"""Cache table (CaR): publish, longest-prefix lookup across holders, evict, scores."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.libs.controlplane import RemoteError
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import CacheEntry
from kvmesh.libs.kvmeta.nodeid import node_ids

from ..conftest import Kvmeta
from ..factories import entries, worker_info

PROMPT = list(range(1000, 1000 + 16 * 6))  # six full blocks of 16 tokens


async def register(client: KvmetaClient, *engines: str) -> None:
    for engine in engines:
        await client.register(worker_info(engine))


async def test_lookup_reports_each_holders_leading_blocks_longest_first(client: KvmetaClient):
    ids = node_ids(PROMPT, 16, model="tiny")
    await register(client, "p0", "p1", "p2")
    await client.publish("p0", entries(ids[:2]))
    await client.publish("p1", entries(ids[:5]))
    await client.publish("p2", entries(ids[:3], tier="cxl") + entries(ids[3:4]))
    matches = await client.lookup(ids)
    assert [(m.engine, m.blocks, m.device_blocks) for m in matches] == [("p1", 5, 5), ("p2", 4, 1), ("p0", 2, 2)]


async def test_a_hole_in_the_chain_ends_a_holders_match(client: KvmetaClient):
    ids = node_ids(PROMPT, 16)
    await register(client, "p0")
    await client.publish("p0", entries([ids[0], ids[1], ids[3], ids[4]]))
    assert [(m.engine, m.blocks) for m in await client.lookup(ids)] == [("p0", 2)]
    assert await client.lookup(ids[1:]) and await client.lookup(ids[2:]) == []


async def test_lookup_of_unknown_or_empty_prefix_matches_nothing(client: KvmetaClient):
    await register(client, "p0")
    await client.publish("p0", entries(node_ids(PROMPT, 16)))
    assert await client.lookup(node_ids([7] * 32, 16)) == []
    assert await client.lookup([]) == []


async def test_evicted_blocks_are_no_longer_found(client: KvmetaClient):
    ids = node_ids(PROMPT, 16)
    await register(client, "p0", "p1")
    await client.publish("p0", entries(ids))
    await client.publish("p1", entries(ids))
    assert await client.evict("p0", ids[2:] + ["never-published"]) == 4
    assert [(m.engine, m.blocks) for m in await client.lookup(ids)] == [("p1", 6), ("p0", 2)]


async def test_score_deltas_apply_atomically_to_existing_entries(client: KvmetaClient, kvmeta: Kvmeta):
    await register(client, "p0")
    await client.publish("p0", [CacheEntry(node_id="n1", tier="device", size=4096, score=1.0),
                                CacheEntry(node_id="n2", tier="cxl", size=4096)])
    # CaR: +1 entering the Shuffled Window, +1 sent to the GPU, -2 when generation completes.
    assert await client.add_scores("p0", {"n1": 1.0, "n2": 1.0, "missing": 1.0}) == 2
    assert await client.add_scores("p0", {"n1": 1.0}) == 1
    assert await client.add_scores("p0", {"n2": -2.0}) == 1
    with kvmeta.redis() as redis:
        stored = {k.decode(): msgspec.json.decode(v) for k, v in redis.hgetall(kvmeta.prefix + "node:n1").items()}
        assert stored == {"p0": {"tier": "device", "size": 4096, "score": 3.0}}
        assert msgspec.json.decode(redis.hget(kvmeta.prefix + "node:n2", "p0"))["score"] == -1.0


async def test_republishing_updates_tier_without_duplicating(client: KvmetaClient):
    await register(client, "p0")
    assert await client.publish("p0", entries(["n1", "n2"], tier="device")) == 2
    assert await client.publish("p0", entries(["n1"], tier="cxl")) == 0  # moved to CXL, not new
    assert [(m.blocks, m.device_blocks) for m in await client.lookup(["n1", "n2"])] == [(2, 1)]


async def test_only_live_workers_may_publish(client: KvmetaClient):
    with pytest.raises(RemoteError) as unknown:
        await client.publish("ghost", entries(["n1"]))
    assert unknown.value.status == 404 and "register" in unknown.value.message
    assert await client.lookup(["n1"]) == []
