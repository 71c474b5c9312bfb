"""The cost of the HTTP hop to kvmeta, against doing the same work straight on Redis.

In one run, on one redis-server and one kvmeta process on loopback:
  - prefix lookups of 64 NodeIDs (two engines hold the chain): through kvmeta over HTTP; straight
    to Redis with a redis-py pipeline (64 HGETALLs, matched in Python; it skips kvmeta's liveness
    check, so it does slightly less); and kvmeta's own Lua script called directly (what kvmeta
    does behind the hop);
  - heartbeats, sequential and with 16 concurrent workers: over HTTP vs a redis-py MULTI pipeline;
  - the ceiling: a bare Redis PING round trip, the floor of any Redis operation.
Keys: hop_added_ms_p50 and hop_added_ms_p99 (HTTP lookup minus pipeline lookup; target <= 1 ms at
p50), lookup_ratio_http_vs_redis (HTTP p50 over pipeline p50), and the stricter
hop_added_ms_p50_vs_same_script (HTTP lookup minus kvmeta's own script called directly: the hop
alone, since the pipeline pays for parsing 64 replies in Python; also held to 1 ms).
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import matplotlib
import msgspec
import numpy as np
import uvloop
from redis.asyncio import Redis
from rich.progress import Progress

from kvmesh.infra.local.processes import free_port, redis_child, service_child
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import BlockGeometry, Capacity, CacheEntry, Load, WorkerInfo
from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.kvmeta.schema import key_prefix, script_source

from .report import BenchResult, latency_row

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CLUSTER = "bench"
BLOCKS = 64
CONCURRENCY = 16
PLOT = Path("bench-results/kvmeta_lookup_latency.png")


def run(quick: bool) -> BenchResult:
    ops = 400 if quick else 4000
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp, asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        redis = redis_child(Path(tmp))
        redis.start()
        redis.wait_ready()
        token, port = secrets.token_urlsafe(16), free_port()
        kvmeta = service_child("kvmeta", Path(tmp), f"http://127.0.0.1:{port}", {
            "KVMESH_KVMETA_PORT": str(port), "KVMESH_REDIS_URL": redis.url, "KVMESH_TOKEN": token,
            "KVMESH_CLUSTER": CLUSTER, "KVMESH_LOG_LEVEL": "WARNING"})
        kvmeta.start()
        try:
            kvmeta.wait_ready()
            return runner.run(_measure(kvmeta.url, token, redis.url, ops, quick))
        finally:
            kvmeta.stop()
            redis.stop()


async def _measure(url: str, token: str, redis_url: str, ops: int, quick: bool) -> BenchResult:
    prefix = key_prefix(CLUSTER)
    chain = node_ids(list(range(BLOCKS * 16)), 16, model="bench")
    async with KvmetaClient(url, token) as client, Redis.from_url(redis_url) as redis:
        for engine in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            await client.register(_worker(engine), ttl_ms=600_000)
        for engine in ("prefill-0", "prefill-1"):
            await client.publish(engine, [CacheEntry(node_id=n, tier="device", size=8192) for n in chain])
        lookup_script = redis.register_script(script_source("lookup"))
        load = Load(free_blocks={"device": 900}, waiting=2, running=8)
        load_json = msgspec.json.encode(load)

        async def http_lookup() -> None:
            matches = await client.lookup(chain)
            assert matches[0].blocks == BLOCKS

        async def pipeline_lookup() -> None:
            pipe = redis.pipeline(transaction=False)
            for node in chain:
                pipe.hgetall(prefix + "node:" + node)
            rows = await pipe.execute()
            holders = {engine: 0 for engine in rows[0]}
            for engine in holders:
                holders[engine] = next((i for i, row in enumerate(rows) if engine not in row), len(rows))
            assert max(holders.values()) == BLOCKS

        async def lua_lookup() -> None:
            await lookup_script(keys=[prefix], args=chain)

        async def http_heartbeat(worker: str = "decode-0") -> None:
            await client.heartbeat(worker, load)

        async def pipeline_heartbeat(worker: str = "decode-0") -> None:
            key, now = prefix + "worker:" + worker, int(time.time() * 1000)
            pipe = redis.pipeline(transaction=True)
            pipe.hset(key, mapping={"load": load_json, "heartbeat_ms": now})
            pipe.pexpire(key, 600_000)
            pipe.zadd(prefix + "workers", {worker: now + 600_000})
            await pipe.execute()

        async def ping() -> None:
            await redis.ping()

        phases: list[tuple[str, str, Callable[[], Awaitable[None]], int]] = [
            ("Redis PING (ceiling)", "redis-py", ping, 1),
            ("lookup 64 NodeIDs", "redis-py pipeline", pipeline_lookup, 1),
            ("lookup 64 NodeIDs", "Lua script direct", lua_lookup, 1),
            ("lookup 64 NodeIDs", "kvmeta over HTTP", http_lookup, 1),
            ("heartbeat", "redis-py MULTI", pipeline_heartbeat, 1),
            ("heartbeat", "kvmeta over HTTP", http_heartbeat, 1),
            (f"heartbeat x{CONCURRENCY} workers", "redis-py MULTI", pipeline_heartbeat, CONCURRENCY),
            (f"heartbeat x{CONCURRENCY} workers", "kvmeta over HTTP", http_heartbeat, CONCURRENCY),
        ]
        rows, samples = [], {}
        with Progress(transient=True) as progress:
            for compared, path, op, concurrency in phases:
                task = progress.add_task(f"{compared} / {path}", total=ops)
                seconds, wall = await _timed(op, ops, concurrency, lambda: progress.advance(task))
                rows.append(latency_row(compared, path, seconds, wall))
                samples[(compared, path)] = seconds
        for engine in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            await client.deregister(engine)

    by = {(r.compared, r.path): r for r in rows}
    http = by[("lookup 64 NodeIDs", "kvmeta over HTTP")].cells
    pipe = by[("lookup 64 NodeIDs", "redis-py pipeline")].cells
    lua = by[("lookup 64 NodeIDs", "Lua script direct")].cells
    beat_http = by[(f"heartbeat x{CONCURRENCY} workers", "kvmeta over HTTP")].cells
    beat_pipe = by[(f"heartbeat x{CONCURRENCY} workers", "redis-py MULTI")].cells
    ratios = {
        "hop_added_ms_p50": http["p50 ms"] - pipe["p50 ms"],
        "hop_added_ms_p99": http["p99 ms"] - pipe["p99 ms"],
        "lookup_ratio_http_vs_redis": http["p50 ms"] / pipe["p50 ms"],
        "hop_added_ms_p50_vs_same_script": http["p50 ms"] - lua["p50 ms"],
        "heartbeat_throughput_ratio_http_vs_redis": beat_http["ops/s"] / beat_pipe["ops/s"],
    }
    targets = {"hop_added_ms_p50": 1.0, "hop_added_ms_p50_vs_same_script": 1.0}
    _plot({k: v for k, v in samples.items() if k[0] == "lookup 64 NodeIDs" or k[0].startswith("Redis")})
    return BenchResult(
        bench="kvmeta", quick=quick, ratios=ratios, targets=targets,
        directions=dict.fromkeys(targets, "<="),
        ceilings={"redis_ping_p50_ms": by[("Redis PING (ceiling)", "redis-py")].cells["p50 ms"]},
        config={"ops_per_phase": ops, "nodeids_per_lookup": BLOCKS, "holders": 2, "concurrency": CONCURRENCY,
                "transport": "loopback", "event_loop": "uvloop"},
        rows=rows, plots=[str(PLOT)],
        headline=f"a 64-NodeID lookup through kvmeta takes {ratios['lookup_ratio_http_vs_redis']:.2f}x the direct "
                 f"pipeline (+{ratios['hop_added_ms_p50']:.3f} ms at p50); the HTTP hop alone adds "
                 f"{ratios['hop_added_ms_p50_vs_same_script']:.3f} ms (target <= 1 ms)")


async def _timed(op: Callable[[], Awaitable[None]], count: int, concurrency: int,
                 advance: Callable[[], None]) -> tuple[list[float], float]:
    """Per-call latencies and wall time of `count` calls, `concurrency` at a time (after a warm-up)."""
    for _ in range(min(50, count)):
        await op()
    seconds: list[float] = []

    async def worker(n: int) -> None:
        for _ in range(n):
            start = time.perf_counter()
            await op()
            seconds.append(time.perf_counter() - start)
            advance()

    began = time.perf_counter()
    await asyncio.gather(*(worker(count // concurrency) for _ in range(concurrency)))
    return seconds, time.perf_counter() - began


def _plot(samples: dict[tuple[str, str], list[float]]) -> None:
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for (compared, path), seconds in samples.items():
        ms = np.sort(np.asarray(seconds) * 1e3)
        ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=f"{compared}: {path}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of calls")
    ax.set_title("kvmeta: 64-NodeID prefix lookup, HTTP hop vs direct Redis")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)


def _worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(id=worker_id, role="prefill" if worker_id.startswith("prefill") else "decode",
                      control_url=f"http://127.0.0.1:1/{worker_id}", model="bench",
                      geometry=BlockGeometry(block_size=16, num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16"),
                      capacity=Capacity(device_blocks=1024))
