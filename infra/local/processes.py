"""Child processes of the local cluster: a redis-server of its own, and kvmesh services.

Used by `kvmesh up`, by the tests (real Redis, real service processes on loopback) and by the
benchmarks, so all three start things the same way.
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.libs.controlplane.ports import free_port


class StartError(RuntimeError):
    pass


ROOT = Path(__file__).resolve().parents[2]
# The virtualenv scripts/setup-vllm.sh makes for vLLM's CPU build, beside kvmesh's own (docs/vllm.md).
VLLM_VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def held_listener(host: str, port: int) -> socket.socket:
    """A listening socket a supervisor keeps for a service and hands to each process it starts for it
    (`listen_fd`): a connection made while the service restarts waits in the kernel's backlog for the
    next process instead of being refused, as with systemd's socket activation."""
    sock = socket.create_server((host, port))  # each service sets its backlog as it serves (serve.py)
    sock.set_inheritable(True)
    return sock


@dataclass
class Child:
    """One supervised process: how to start it and how to tell it is ready; `listener`, when given, is
    the listening socket every process of it serves (held_listener)."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    url: str = ""
    process: subprocess.Popen | None = None
    restarts: int = 0
    listener: socket.socket | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        inherited = {"KVMESH_LISTEN_FD": str(self.listener.fileno())} if self.listener else {}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.env, **inherited}, start_new_session=True,
                                            pass_fds=(self.listener.fileno(),) if self.listener else ())

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not gone within `timeout`. A kvmesh service asked for its
        stacks (SIGUSR1) first writes them to its log, which then shows where the shutdown hung."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            if self.url.startswith("http"):  # a kvmesh service, not redis-server
                self.process.send_signal(signal.SIGUSR1)
                time.sleep(0.5)
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        """Stop the process and let go of its listening socket: the port is free after this."""
        self.stop()
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.exited()
            if code is not None:
                raise StartError(f"{self.name} exited with code {code} while starting; see {self.log_path}:\n"
                                 + tail(self.log_path))
            if is_ready(self.url):
                return
            time.sleep(0.05)
        raise StartError(f"{self.name} was not ready within {timeout:.0f}s; see {self.log_path}:\n" + tail(self.log_path))


def redis_child(run_dir: Path, host: str = "127.0.0.1", port: int | None = None) -> Child:
    """A redis-server on loopback with its own data directory and no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise StartError("redis-server is not installed: run scripts/setup.sh (it installs Debian's redis-server)")
    port = port or free_port(host)
    data = run_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    argv = [binary, "--port", str(port), "--bind", host, "--dir", str(data), "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--protected-mode", "yes"]
    return Child("redis", argv, run_dir / "logs" / "redis.log", url=f"redis://{host}:{port}/0")


@dataclass
class SentinelGroup:
    """A Redis master, one replica and three Sentinels (quorum 2) watching them, all on loopback: the
    failover docs/deploy.md deploys, for tests and benchmarks. kvmeta follows it with
    `redis_sentinels = sentinels` and `redis_master = name`."""

    name: str
    master: Child
    replica: Child
    sentinel_children: list[Child]

    @property
    def sentinels(self) -> list[str]:
        return ["%s:%d" % redis_address(child.url) for child in self.sentinel_children]

    def master_port(self) -> int:
        """The port of the master the Sentinels name now (it changes with a failover)."""
        import redis  # here: .venv-vllm's benchmark client imports this module without redis-py

        host, port = redis_address(self.sentinel_children[0].url)
        with redis.Redis(host=host, port=port, socket_timeout=1.0) as sentinel:
            return int(sentinel.sentinel_get_master_addr_by_name(self.name)[1])

    def stop(self) -> None:
        for child in [*self.sentinel_children, self.replica, self.master]:
            child.stop()


def sentinel_group(run_dir: Path, name: str = "kvmesh", down_after_ms: int = 500) -> SentinelGroup:
    """Start a master, a replica of it and three Sentinels, each waited on; `down_after_ms`: how long
    the master may not answer before the Sentinels fail over."""
    master = redis_child(run_dir / "master")
    master.start()
    master.wait_ready()
    master_port = redis_address(master.url)[1]
    replica = redis_child(run_dir / "replica")
    replica.argv += ["--replicaof", "127.0.0.1", str(master_port)]
    replica.start()
    replica.wait_ready()
    sentinels = []
    for index in range(3):
        port = free_port()
        config = run_dir / f"sentinel-{index}.conf"
        config.write_text(f"port {port}\nbind 127.0.0.1\ndir {run_dir}\n"
                          f"sentinel monitor {name} 127.0.0.1 {master_port} 2\n"
                          f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
                          f"sentinel failover-timeout {name} 5000\n")
        child = Child(f"sentinel-{index}", [shutil.which("redis-server"), str(config), "--sentinel"],
                      run_dir / "logs" / f"sentinel-{index}.log", url=f"redis://127.0.0.1:{port}/0")
        child.start()
        sentinels.append(child)
    for child in sentinels:
        child.wait_ready()
    return SentinelGroup(name, master, replica, sentinels)


def service_child(service: str, run_dir: Path, url: str, env: dict[str, str], config: str | None = None,
                  name: str | None = None, python: str = sys.executable) -> Child:
    """`kvmesh serve SERVICE` as a child; `name` tells instances of one service apart (default: the service);
    `python` runs it (an engine on the vLLM backend needs one with vLLM)."""
    argv = [python, "-m", "kvmesh", "serve", service] + (["--config", config] if config else [])
    name = name or service
    return Child(name, argv, run_dir / "logs" / f"{name}.log", env=env, url=url)


def vllm_python() -> str:
    """A Python that runs vLLM: this one when it has vLLM (`pip install kvmesh[vllm]`), else .venv-vllm."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if VLLM_VENV_PYTHON.exists():
        return str(VLLM_VENV_PYTHON)
    raise StartError("the vLLM backend needs vLLM: `pip install kvmesh[vllm]` (GPU), or scripts/setup-vllm.sh "
                     "(vLLM's CPU build, into .venv-vllm)")


def redis_address(url: str) -> tuple[str, int]:
    """The host and port of a `redis://host:port/db` URL."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def is_ready(url: str) -> bool:
    """A Redis answers PING; a kvmesh service answers `GET /ready` with 200."""
    return redis_answers(url) if url.startswith("redis://") else http_ok(url + "/ready")


def redis_answers(url: str) -> bool:
    host, port = redis_address(url)
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
