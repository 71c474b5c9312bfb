"""What must hold in a cluster's Redis namespace after any sequence of kvmeta operations."""

from __future__ import annotations

import redis as redis_sync


def assert_consistent(redis: redis_sync.Redis, prefix: str) -> None:
    live = {m.decode() for m in redis.zrange(prefix + "workers", 0, -1)}
    for key in redis.scan_iter(match=f"{prefix}worker:*".replace("{", "\\{").replace("}", "\\}")):
        assert key.decode()[len(prefix) + 7:] in live, f"{key} has no entry in the workers index"
    for key in redis.scan_iter(match=f"{prefix}node:*".replace("{", "\\{").replace("}", "\\}")):
        node = key.decode()[len(prefix) + 5:]
        for engine in redis.hkeys(key):
            engine = engine.decode()
            assert engine in live, f"cache entry {node} of {engine}, which is no live worker"
            assert redis.sismember(f"{prefix}held:{engine}", node), f"{node} of {engine} missing from its index"
    for key in redis.scan_iter(match=f"{prefix}held:*".replace("{", "\\{").replace("}", "\\}")):
        engine = key.decode()[len(prefix) + 5:]
        assert engine in live, f"held index of {engine}, which is no live worker"
        for node in redis.smembers(key):
            assert redis.hexists(f"{prefix}node:{node.decode()}", engine), f"index names {node} but {engine} lacks it"
    for rid, _ in redis.zrange(prefix + "leases", 0, -1, withscores=True):
        rid = rid.decode()
        engine = redis.hget(f"{prefix}blocks:{rid}", "engine")
        assert engine is not None, f"lease {rid} without a record"
        assert engine.decode() in live, f"lease {rid} on {engine}, which is no live worker"
        assert redis.sismember(f"{prefix}leases:{engine.decode()}", rid)
