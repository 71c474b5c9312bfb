"""Fixtures: a real redis-server and real kvmeta processes on loopback.

The suite runs on two xdist workers on two cores, so every process it starts computes on one torch
thread: two workers each running torch on two threads would oversubscribe the cores, and an OpenMP
barrier then waits for a descheduled thread (a smoke bench took 140 s that way, 47 s on one thread).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_sync
import torch

from kvmesh.infra.local.processes import Child, free_port, redis_child, service_child
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.schema import key_prefix

from .kvmeta_invariants import assert_consistent

TOKEN = "test-cluster-token"

torch.set_num_threads(1)                                   # this worker's in-process engines
for service in ("ENGINE", "PREDICTOR"):                    # the engines and predictors it starts
    os.environ.setdefault(f"KVMESH_{service}_TORCH_THREADS", "1")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One redis-server for the session; each test gets its own cluster namespace in it."""
    child = redis_child(tmp_path_factory.mktemp("redis"))
    child.start()
    child.wait_ready()
    yield child.url
    child.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Child]:
    """A redis-server for one test, to kill and restart."""
    child = redis_child(tmp_path)
    child.start()
    child.wait_ready()
    yield child
    child.stop()


@dataclass
class Kvmeta:
    child: Child
    url: str
    cluster: str
    redis_url: str

    def client(self, token: str | None = TOKEN, **options: object) -> KvmetaClient:
        return KvmetaClient(self.url, token=token, **options)

    def redis(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.redis_url)

    @property
    def prefix(self) -> str:
        return key_prefix(self.cluster)


def start_kvmeta(run_dir: Path, redis_url: str, cluster: str, **env: str) -> Kvmeta:
    port = free_port()
    child = service_child("kvmeta", run_dir, f"http://127.0.0.1:{port}", {
        "KVMESH_KVMETA_PORT": str(port), "KVMESH_REDIS_URL": redis_url, "KVMESH_CLUSTER": cluster,
        "KVMESH_TOKEN": TOKEN, "KVMESH_KVMETA_REAP_INTERVAL_S": "0.05", **env})
    child.start()
    child.wait_ready()
    return Kvmeta(child, child.url, cluster, redis_url)


def cluster_name(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:40] + "-" + uuid.uuid4().hex[:8]


@pytest.fixture
def kvmeta(tmp_path: Path, redis_url: str, request: pytest.FixtureRequest) -> Iterator[Kvmeta]:
    """A kvmeta process on its own cluster namespace. After the test, the namespace must be
    consistent: no cache entry or lease of a worker that is gone, every index matching its data."""
    service = start_kvmeta(tmp_path, redis_url, cluster_name(request))
    yield service
    try:
        with service.redis() as redis:
            assert_consistent(redis, service.prefix)
    finally:
        service.child.stop()


@pytest.fixture
async def client(kvmeta: Kvmeta) -> AsyncIterator[KvmetaClient]:
    async with kvmeta.client() as c:
        yield c
