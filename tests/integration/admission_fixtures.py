"""Small real clusters for admission's tests, all on loopback: redis-server, kvmeta, engines (the `tiny`
preset), the scheduler and admission, each a process of its own."""

from __future__ import annotations

import asyncio
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.infra.local.processes import Child, free_port, service_child
from kvmesh.libs.controlplane import ServiceClient

from ..conftest import TOKEN, Kvmeta, start_kvmeta

MODEL = "tiny"


@dataclass
class Cluster:
    kvmeta: Kvmeta
    scheduler: Child
    admission: Child
    engines: dict[str, Child] = field(default_factory=dict)  # by engine id


def launch(name: str, run_dir: Path, python: str = sys.executable, **env: str) -> Child:
    """Start a kvmesh service (not yet waited on), run by `python`."""
    port = free_port()
    child = service_child(name, run_dir, f"http://127.0.0.1:{port}",
                          {f"KVMESH_{name.upper()}_PORT": str(port), "KVMESH_TOKEN": TOKEN, **env}, python=python)
    child.start()
    return child


def launch_engine(run_dir: Path, kvmeta_url: str, engine_id: str, role: str, python: str = sys.executable,
                  **env: str) -> Child:
    return launch("engine", run_dir / engine_id, python, **{
        "KVMESH_ENGINE_MODEL": MODEL, "KVMESH_ENGINE_DTYPE": "float32", "KVMESH_ENGINE_ENGINE_ID": engine_id,
        "KVMESH_ENGINE_ROLE": role,
        "KVMESH_ENGINE_KVMETA_URL": kvmeta_url, "KVMESH_ENGINE_TORCH_THREADS": "1", **env})


def start_cluster(stack: ExitStack, run_dir: Path, redis_url: str, cluster: str, roles: dict[str, str],
                  engine_env: dict[str, str] | None = None, every_env: dict[str, str] | None = None,
                  **admission_env: str) -> Cluster:
    """kvmeta, then engines of the given roles (by id), the scheduler and admission, started together
    (their start-ups overlap) and each waited on; each is stopped when `stack` closes. `every_env` goes
    to every service."""
    every = every_env or {}
    kvmeta = start_kvmeta(run_dir, redis_url, cluster, **every)
    stack.callback(kvmeta.child.stop)
    engines = {engine_id: launch_engine(run_dir, kvmeta.url, engine_id, role, **{**every, **(engine_env or {})})
               for engine_id, role in roles.items()}
    scheduler = launch("scheduler", run_dir, KVMESH_KVMETA_URL=kvmeta.url, **every)
    admission = launch("admission", run_dir, KVMESH_SCHEDULER_URL=scheduler.url, **every, **admission_env)
    children = [*engines.values(), scheduler, admission]
    for child in children:
        stack.callback(child.stop)
    for child in children:
        child.wait_ready(timeout=120)
    return Cluster(kvmeta, scheduler, admission, engines)


def ready(stack: ExitStack, child: Child) -> Child:
    stack.callback(child.stop)
    child.wait_ready()
    return child


def idle(state: dict) -> bool:
    return (state["free_blocks"] == state["total_blocks"] and not state["running"] and not state["waiting"]
            and not state.get("pulling") and not state.get("held_kv") and not state.get("pushing"))


async def engine_state(engine_url: str, token: str = TOKEN) -> dict:
    async with ServiceClient(engine_url, token=token) as client:
        return await client.call("GET", "/v1/state", into=dict)


async def wait_until_idle(engine_url: str, timeout: float = 5.0, token: str = TOKEN) -> dict:
    """The engine's state once nothing runs, waits, pulls or is held and every block is free (or at the timeout)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = await engine_state(engine_url, token)
        if idle(state) or asyncio.get_running_loop().time() > deadline:
            return state
        await asyncio.sleep(0.05)
