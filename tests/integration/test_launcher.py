"""`kvmesh up`, `kvmesh status`, `kvmesh down`: the local cluster as a user runs it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from kvmesh.infra.local.processes import free_port, http_ok
from kvmesh.infra.local.state import pid_alive
from kvmesh.infra.local.status import Status
from kvmesh.libs.controlplane import ServiceClient
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.services.engine.engine import Frame


def kvmesh(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60, **kw)


def status(run_dir: Path) -> Status:
    return msgspec.json.decode(kvmesh("status", "--run-dir", str(run_dir), "--json").stdout, type=Status)


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.fixture
def cluster(tmp_path: Path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "KVMESH_KVMETA_PORT": str(free_port()), "KVMESH_ENGINE_PORT": str(free_port()),
           "KVMESH_ENGINE_TORCH_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "kvmesh", "up", "--run-dir", str(run_dir)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (s := status(run_dir)).running and len(s.children) == 3 and all(c.ready for c in s.children))
        yield launcher, run_dir
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(30)


def test_up_starts_redis_and_kvmeta_and_status_reports_them(cluster):
    launcher, run_dir = cluster
    current = status(run_dir)
    assert [c.name for c in current.children] == ["redis", "kvmeta", "engine"]
    kvmeta = current.children[1]
    assert http_ok(kvmeta.url + "/ready")
    assert (run_dir / "token").stat().st_mode & 0o077 == 0  # the generated token is private
    assert kvmesh("status", "--run-dir", str(run_dir)).returncode == 0


async def test_the_colocated_engine_serves_and_is_registered(cluster):
    launcher, run_dir = cluster
    token = (run_dir / "token").read_text().strip()
    by_name = {c.name: c for c in status(run_dir).children}
    async with KvmetaClient(by_name["kvmeta"].url, token) as kvmeta:
        workers = await kvmeta.workers()
    assert [(w.info.id, w.info.role) for w in workers] == [("engine-0", "both")]
    async with ServiceClient(by_name["engine"].url, token=token) as engine:
        frames = [f async for f in engine.frames("/v1/generate", {"prompt": "hello", "max_tokens": 4,
                                                                  "ignore_eos": True}, Frame)]
    assert frames[-1].finish_reason == "length" and frames[-1].usage.completion_tokens == 4


def test_a_crashed_service_is_restarted(cluster):
    launcher, run_dir = cluster
    old = status(run_dir).children[1]
    os.kill(old.pid, signal.SIGKILL)
    new = wait_for(lambda: next((c for c in status(run_dir).children if c.name == "kvmeta" and c.pid != old.pid
                                 and c.ready), None))
    assert new.restarts == 1 and http_ok(new.url + "/ready")


def test_sigterm_stops_everything_cleanly(cluster):
    launcher, run_dir = cluster
    pids = [c.pid for c in status(run_dir).children]
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, output
    assert not any(pid_alive(pid) for pid in pids)
    assert not status(run_dir).running and not (run_dir / "state.json").exists()


def test_down_stops_a_running_cluster_and_second_up_is_refused(cluster):
    launcher, run_dir = cluster
    second = kvmesh("up", "--run-dir", str(run_dir))
    assert second.returncode == 1 and "already runs" in second.stderr
    assert kvmesh("down", "--run-dir", str(run_dir)).returncode == 0
    launcher.wait(30)
    assert kvmesh("status", "--run-dir", str(run_dir)).returncode == 1


def test_taken_port_is_a_clear_error(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = kvmesh("up", "--run-dir", str(tmp_path), env={"KVMESH_KVMETA_PORT": str(port)})
    assert result.returncode == 1 and f"port {port} for kvmeta is taken" in result.stderr
    assert not (tmp_path / "state.json").exists()
