"""The cache table's longest-prefix lookup, through kvmeta and Redis, against a plain-Python model."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.libs.kvmeta.messages import CacheEntry

from ..conftest import Kvmeta, start_kvmeta
from ..factories import worker_info
from ..kvmeta_invariants import assert_consistent

ENGINES = ["e0", "e1", "e2"]
NODES = [f"n{i}" for i in range(6)]  # one prompt's chain of blocks, n0 first

# Each engine starts holding a random part of the chain (mostly held, with holes), in random tiers;
# then publishes, evictions and departures follow.
tier = st.sampled_from(["device", "cxl"])
holding = st.lists(st.one_of(tier, tier, tier, st.none()), min_size=len(NODES), max_size=len(NODES))
initial = st.fixed_dictionaries({e: holding for e in ENGINES})
publish = st.tuples(st.just("publish"), st.sampled_from(ENGINES),
                    st.lists(st.tuples(st.sampled_from(NODES), tier), min_size=1, max_size=6))
evict = st.tuples(st.just("evict"), st.sampled_from(ENGINES), st.lists(st.sampled_from(NODES), max_size=4))
leave = st.tuples(st.just("leave"), st.sampled_from(ENGINES), st.just([]))
operations = st.lists(st.one_of(publish, evict, evict, leave), max_size=10)
# Mostly the chain's own prefixes (what a scheduler asks), sometimes arbitrary lists.
prefixes = st.lists(st.one_of(st.integers(1, len(NODES)).map(lambda k: NODES[:k]),
                              st.lists(st.sampled_from(NODES), max_size=6)), min_size=1, max_size=4)


def model_lookup(table: dict[str, dict[str, str]], live: set[str], prefix: list[str]) -> list[tuple[str, int, int]]:
    """For each live holder of the first block: leading blocks held, and how many of those are in device."""
    result = []
    for engine in sorted(live):
        blocks = device = 0
        for node in prefix:
            tier = table.get(node, {}).get(engine)
            if tier is None:
                break
            blocks += 1
            device += tier == "device"
        if blocks:
            result.append((engine, blocks, device))
    return sorted(result, key=lambda m: (-m[1], -m[2], m[0]))


@pytest.fixture(scope="module")
def shared_kvmeta(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvmeta]:
    service = start_kvmeta(tmp_path_factory.mktemp("kvmeta"), redis_url, "property-" + uuid.uuid4().hex[:8])
    yield service
    service.child.stop()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(initial, operations, prefixes)
def test_lookup_matches_the_model(shared_kvmeta: Kvmeta, start, ops, queries):
    held = [("publish", e, [(n, t) for n, t in zip(NODES, tiers) if t]) for e, tiers in start.items()]
    asyncio.run(check(shared_kvmeta, held + ops, queries))


async def check(kvmeta: Kvmeta, ops, queries) -> None:
    run = uuid.uuid4().hex[:6]  # engines of this example only
    name = {e: f"{e}-{run}" for e in ENGINES}
    table: dict[str, dict[str, str]] = {}
    live = set(ENGINES)
    async with kvmeta.client() as client:
        for engine in ENGINES:
            await client.register(worker_info(name[engine]))
        for op, engine, args in ops:
            if op == "publish" and engine in live:
                await client.publish(name[engine], [CacheEntry(node_id=n, tier=t, size=1) for n, t in args])
                for node, tier in args:
                    table.setdefault(node, {})[engine] = tier
            elif op == "evict":
                await client.evict(name[engine], args)
                for node in args:
                    table.get(node, {}).pop(engine, None)
            elif op == "leave" and engine in live:
                await client.deregister(name[engine])
                live.discard(engine)
                for holders in table.values():
                    holders.pop(engine, None)
        for prefix in queries:
            got = [(m.engine, m.blocks, m.device_blocks) for m in await client.lookup(prefix)]
            want = [(name[e], b, d) for e, b, d in model_lookup(table, live, prefix)]
            assert sorted(got, key=lambda m: (-m[1], -m[2], m[0])) == sorted(want, key=lambda m: (-m[1], -m[2], m[0]))
        with kvmeta.redis() as redis:
            assert_consistent(redis, kvmeta.prefix)
        for engine in live:
            await client.deregister(name[engine])
