"""`kvmesh up`: the whole cluster on one machine, supervised.

Starts a redis-server of its own (unless a Redis URL is given), then each kvmesh service in
dependency order, each waited on until `GET /ready` answers; prints the endpoints; restarts a child
that dies, with exponential backoff; and on Ctrl-C or SIGTERM stops everything, last started first.
Later services find earlier ones through `KVMESH_<NAME>_URL`, which the launcher exports.
The engines follow a topology (topology.py: 1 prefill + 1 decode by default, or one colocated
engine); each is `kvmesh serve engine` with its own id, role and port, and `kvmesh scale` (SIGHUP
with a new topology in the run directory) starts or stops engines while the cluster serves.
`--backend vllm` runs the engines on stock vLLM (docs/vllm.md), each with a Python that has vLLM.
`kvmesh swap` (swap.py) replaces a policy service or the engines' policies; what it records in the
run directory reaches every admission and engine started after it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.libs.controlplane import ServiceConfig, load_config
from kvmesh.services.configs import config_class
from kvmesh.services.engine.model_source import resolve_model

from .processes import Child, StartError, held_listener, port_in_use, redis_child, service_child, vllm_python
from .state import ChildState, ClusterState, api_key, cluster_token, pid_alive, read_state, state_path, write_state
from .swap import swapped_env, swaps_path
from .topology import Topology, read_wanted, wanted_path, write_wanted

# Started in this order, the engines between the scheduler and admission; a service whose code is
# not there (an issue not built yet) is skipped.
CONTROL_SERVICES = ("kvmeta", "predictor", "scheduler")
FRONT_SERVICES = ("admission",)

STABLE_AFTER_S = 30.0  # a child that ran this long before dying restarts without delay growth
MAX_BACKOFF_S = 30.0

console = Console(highlight=False)


def up(run_dir: Path, config: str | None = None, redis_url: str | None = None,
       topology: Topology = Topology(), backend: str = "native", model: str | None = None,
       exit_with_parent: bool = False) -> int:
    parent = os.getppid() if exit_with_parent else None
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = read_state(run_dir)
    if previous is not None and pid_alive(previous.launcher_pid):
        raise StartError(f"a cluster already runs from {run_dir} (launcher pid {previous.launcher_pid}); "
                         "stop it with `kvmesh down` or pick another --run-dir")
    shared = load_config(ServiceConfig, None, config)
    token, token_file = cluster_token(run_dir, shared.token)
    key, key_file = api_key(run_dir, os.environ.get("KVMESH_API_KEY"))
    env = {"KVMESH_TOKEN": token, "KVMESH_CLUSTER": shared.cluster}
    if model is not None:
        env["KVMESH_ENGINE_MODEL"] = model
    cluster = _Cluster(run_dir, config, env, backend)
    # A GGUF model is converted here, once, with progress, rather than by each engine as it starts.
    resolve_model(model or cluster.engine_config().model, report=lambda line: console.print(f"kvmesh: {line}"))
    stopping, rescale = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    signal.signal(signal.SIGHUP, lambda *_: rescale.set())
    write_wanted(run_dir, topology)
    swaps_path(run_dir).unlink(missing_ok=True)  # a new cluster starts with its own policy services
    try:
        if redis_url is None:
            redis = redis_child(run_dir)
            cluster.start(redis)
            redis_url = redis.url
        env["KVMESH_REDIS_URL"] = redis_url
        for name in [n for n in CONTROL_SERVICES if _exists(n)]:
            cluster.start_service(name)
        cluster.scale_engines(topology)
        for name in [n for n in FRONT_SERVICES if _exists(n)]:
            cluster.start_service(name, {"KVMESH_API_KEY": key})
        cluster.save(token_file)
        _print_endpoints(cluster.children, token_file, key_file, run_dir, redis_url)
        _supervise(cluster, stopping, rescale, token_file, parent)
        return 0
    finally:
        for child in reversed(cluster.children):
            child.close()
        state_path(run_dir).unlink(missing_ok=True)
        wanted_path(run_dir).unlink(missing_ok=True)
        swaps_path(run_dir).unlink(missing_ok=True)
        console.print("kvmesh: stopped")


class _Cluster:
    """The children of one `kvmesh up`, and how to start one more or stop one."""

    def __init__(self, run_dir: Path, config: str | None, env: dict[str, str], backend: str = "native"):
        self.run_dir, self.config, self.env = run_dir, config, env
        self.children: list[Child] = []
        self.python = vllm_python() if backend == "vllm" else sys.executable  # before anything starts
        self.backend = backend

    def start(self, *children: Child) -> None:
        """Start the children side by side, then wait until each is ready."""
        for child in children:
            console.print(f"kvmesh: starting {child.name} ...")
            self.children.append(child)
            self.run(child)
        for child in children:
            child.wait_ready(timeout=120)

    def run(self, child: Child) -> None:
        """Start (or restart) the child's process, told of the policy swaps made so far."""
        policies = self._config("engine").policies if child.name.startswith("engine-") else {}
        child.env.update(swapped_env(self.run_dir, child.name, policies))
        child.start()

    def start_service(self, name: str, extra: dict[str, str] | None = None) -> None:
        """A stateless service, on a listening socket the launcher holds across its restarts (a request
        to it while it restarts waits instead of failing); engines bind their own, so that callers fail
        over to another engine at once."""
        service_config = self._config(name)
        try:
            listener = held_listener(service_config.host, service_config.port)
        except OSError as exc:
            raise StartError(f"port {service_config.port} for {name} is taken ({exc.strerror}): free it or set "
                             f"KVMESH_{name.upper()}_PORT") from None
        url = f"http://{service_config.host}:{listener.getsockname()[1]}"
        child = service_child(name, self.run_dir, url, {**self.env, **(extra or {})}, self.config)
        child.listener = listener
        self.start(child)
        self.env[f"KVMESH_{name.upper()}_URL"] = url  # later services find this one here

    def engines(self) -> list[Child]:
        return [c for c in self.children if c.name.startswith("engine-")]

    def scale_engines(self, topology: Topology) -> None:
        """Start the engines the topology has and we do not; stop (deregistering) those we should not."""
        wanted = {spec.name: spec for spec in topology.engines()}
        for child in self.engines():
            if child.name not in wanted:
                console.print(f"kvmesh: stopping {child.name}")
                child.stop()
                self.children.remove(child)
        running = {c.name for c in self.engines()}
        base = self._config("engine")
        threads = base.torch_threads or max(1, (os.cpu_count() or 1) // max(1, len(wanted)))
        taken = {int(c.url.rsplit(":", 1)[1]) for c in self.children if c.url.startswith("http")}
        cores = sorted(os.sched_getaffinity(0))
        starting = []
        for index, spec in enumerate(wanted.values()):
            if spec.name in running:
                continue
            port = base.port
            while port in taken or port_in_use(base.host, port):
                port += 1
            taken.add(port)
            env = {**self.env, "KVMESH_ENGINE_ENGINE_ID": spec.name, "KVMESH_ENGINE_ROLE": spec.role,
                   "KVMESH_ENGINE_PORT": str(port), "KVMESH_ENGINE_TORCH_THREADS": str(threads)}
            if self.backend == "vllm":
                env.update(_vllm_engine_env(base, cores[index % len(cores)], threads))
            starting.append(service_child("engine", self.run_dir, f"http://{base.host}:{port}", env, self.config,
                                          name=spec.name, python=self.python))
        self.start(*starting)  # engines are independent of each other: they load their models at once

    def save(self, token_file: Path) -> None:
        write_state(self.run_dir, ClusterState(
            launcher_pid=os.getpid(), started_at=time.time(), token_file=str(token_file),
            children=[ChildState(name=c.name, pid=c.pid, url=c.url, log=str(c.log_path), restarts=c.restarts)
                      for c in self.children]))

    def engine_config(self) -> ServiceConfig:
        return self._config("engine")

    def _config(self, name: str) -> ServiceConfig:
        return load_config(config_class(name), name, self.config,
                           env={**os.environ, **self.env})


def _vllm_engine_env(base: ServiceConfig, core: int, threads: int) -> dict[str, str]:
    """An engine on stock vLLM: that backend, blocks vLLM's CPU build takes (a multiple of 32 tokens),
    and on the CPU its OMP threads bound to a core of its own, so engines side by side do not fight."""
    env = {"KVMESH_ENGINE_BACKEND": "vllm"}
    if base.device == "cpu":
        env.update(VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS=str(threads))
        if base.block_size % 32:
            env["KVMESH_ENGINE_BLOCK_SIZE"] = "32"
    return env


def _exists(service: str) -> bool:
    return importlib.util.find_spec(f"kvmesh.services.{service}.app") is not None


def _supervise(cluster: _Cluster, stopping: threading.Event, rescale: threading.Event, token_file: Path,
               parent: int | None) -> None:
    """Restart children that die and carry out `kvmesh scale`, until asked to stop or, when `parent` is
    given, until that process has gone (this one is then re-parented)."""
    children = cluster.children
    streak: dict[str, int] = {}
    started: dict[str, float] = {}
    due: dict[str, float] = {}
    while not stopping.wait(0.2):
        if parent is not None and os.getppid() != parent:
            console.print(f"kvmesh: the process that started this cluster (pid {parent}) has exited; stopping")
            return
        if rescale.is_set():
            rescale.clear()
            wanted = read_wanted(cluster.run_dir)
            if wanted is not None:
                try:
                    cluster.scale_engines(wanted)
                except StartError as exc:
                    console.print(f"kvmesh: scaling failed: {exc}")
                cluster.save(token_file)
        now = time.monotonic()
        for child in children:
            streak.setdefault(child.name, 0)
            started.setdefault(child.name, now)
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
                cluster.run(child)
                child.restarts += 1
                started[child.name] = now
                cluster.save(token_file)


def _print_endpoints(children: list[Child], token_file: Path, key_file: Path, run_dir: Path, redis_url: str) -> None:
    table = Table(title="kvmesh is up")
    for column in ("service", "endpoint", "pid", "log"):
        table.add_column(column)
    for child in children:
        table.add_row(child.name, child.url, str(child.pid), str(child.log_path))
    if not any(c.name == "redis" for c in children):
        table.add_row("redis", redis_url, "-", "(external)")
    console.print(table)
    front = next((c for c in children if c.name == "admission"), None)
    if front is not None:
        key = "from KVMESH_API_KEY" if os.environ.get("KVMESH_API_KEY") else key_file.read_text().strip()
        console.print(f"OpenAI API: {front.url}/v1   API key: {key} (in {key_file})")
    console.print(f"service token: {token_file}   status: kvmesh status --run-dir {run_dir}   stop: Ctrl-C   "
                  f"scale: kvmesh scale --prefill N --decode M")
