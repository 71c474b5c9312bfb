"""`kvmesh up`: the whole cluster on one machine, supervised.

Starts a redis-server of its own (unless a Redis URL is given), then each kvmesh service in
dependency order, each waited on until `GET /ready` answers; prints the endpoints; restarts a child
that dies, with exponential backoff; and on Ctrl-C or SIGTERM stops everything, last started first.
Later services find earlier ones through `KVMESH_<NAME>_URL`, which the launcher exports.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.libs.controlplane import ServiceConfig, load_config

from .processes import Child, StartError, port_in_use, redis_child, service_child
from .state import ChildState, ClusterState, cluster_token, pid_alive, read_state, state_path, write_state

# Started in this order; each later issue adds its service here.
LOCAL_SERVICES = ("kvmeta", "engine")

STABLE_AFTER_S = 30.0  # a child that ran this long before dying restarts without delay growth
MAX_BACKOFF_S = 30.0

console = Console(highlight=False)


def up(run_dir: Path, config: str | None = None, redis_url: str | None = None) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = read_state(run_dir)
    if previous is not None and pid_alive(previous.launcher_pid):
        raise StartError(f"a cluster already runs from {run_dir} (launcher pid {previous.launcher_pid}); "
                         "stop it with `kvmesh down` or pick another --run-dir")
    shared = load_config(ServiceConfig, None, config)
    token, token_file = cluster_token(run_dir, shared.token)
    env = {"KVMESH_TOKEN": token, "KVMESH_CLUSTER": shared.cluster}
    children: list[Child] = []
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        if redis_url is None:
            redis = redis_child(run_dir)
            _start(redis, children)
            redis_url = redis.url
        env["KVMESH_REDIS_URL"] = redis_url
        for name in LOCAL_SERVICES:
            if stopping.is_set():
                return 130
            service_config = load_config(importlib.import_module(f"kvmesh.services.{name}.app").Config, name, config,
                                         env={**os.environ, **env})
            if port_in_use(service_config.host, service_config.port):
                raise StartError(f"port {service_config.port} for {name} is taken: free it or set "
                                 f"KVMESH_{name.upper()}_PORT")
            url = f"http://{service_config.host}:{service_config.port}"
            _start(service_child(name, run_dir, url, dict(env), config), children)
            env[f"KVMESH_{name.upper()}_URL"] = url
        _save(run_dir, token_file, children)
        _print_endpoints(children, token_file, run_dir, redis_url)
        _supervise(children, stopping, run_dir, token_file)
        return 0
    finally:
        for child in reversed(children):
            child.stop()
        state_path(run_dir).unlink(missing_ok=True)
        console.print("kvmesh: stopped")


def _start(child: Child, children: list[Child]) -> None:
    console.print(f"kvmesh: starting {child.name} ...")
    children.append(child)
    child.start()
    child.wait_ready()


def _supervise(children: list[Child], stopping: threading.Event, run_dir: Path, token_file: Path) -> None:
    streak = {child.name: 0 for child in children}
    started = {child.name: time.monotonic() for child in children}
    due: dict[str, float] = {}
    while not stopping.wait(0.2):
        now = time.monotonic()
        for child in children:
            code = child.exited()
            if code is None or child.name in due:
                continue
            streak[child.name] = 0 if now - started[child.name] > STABLE_AFTER_S else streak[child.name] + 1
            delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (streak[child.name] - 1)) if streak[child.name] else 0.0
            console.print(f"kvmesh: {child.name} (pid {child.pid}) exited with code {code}; "
                          f"restarting in {delay:.1f}s (log: {child.log_path})")
            due[child.name] = now + delay
        for child in children:
            if child.name in due and now >= due[child.name]:
                del due[child.name]
                child.start()
                child.restarts += 1
                started[child.name] = now
                _save(run_dir, token_file, children)


def _save(run_dir: Path, token_file: Path, children: list[Child]) -> None:
    write_state(run_dir, ClusterState(
        launcher_pid=os.getpid(), started_at=time.time(), token_file=str(token_file),
        children=[ChildState(name=c.name, pid=c.pid, url=c.url, log=str(c.log_path), restarts=c.restarts)
                  for c in children]))


def _print_endpoints(children: list[Child], token_file: Path, run_dir: Path, redis_url: str) -> None:
    table = Table(title="kvmesh is up")
    for column in ("service", "endpoint", "pid", "log"):
        table.add_column(column)
    for child in children:
        table.add_row(child.name, child.url, str(child.pid), str(child.log_path))
    if not any(c.name == "redis" for c in children):
        table.add_row("redis", redis_url, "-", "(external)")
    console.print(table)
    console.print(f"service token: {token_file}   status: kvmesh status --run-dir {run_dir}   stop: Ctrl-C")
