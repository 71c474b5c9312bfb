"""`kvmesh up`, `kvmesh status`, `kvmesh down`: the local cluster as a user runs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import openai
import pytest

from kvmesh.infra.local.processes import free_port, http_ok, tail
from kvmesh.infra.local.state import pid_alive
from kvmesh.infra.local.status import Status
from kvmesh.libs.controlplane import ServiceClient
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.messages.engine import Frame
from kvmesh.services.engine.model_source import DEFAULT_MODEL

from .test_policy_swap import counter, ratio_predictor


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


SERVICES = ["redis", "kvmeta", "predictor", "scheduler", "engine-p0", "engine-d0", "admission"]


def ports() -> dict[str, str]:
    """0 for the services whose sockets the launcher binds itself (at once: a port picked here and
    bound later can be taken meanwhile by another test's process); engines bind their own, from a
    free base port up."""
    return {**{f"KVMESH_{name}_PORT": "0" for name in ("KVMETA", "PREDICTOR", "SCHEDULER", "ADMISSION")},
            "KVMESH_ENGINE_PORT": str(free_port())}


def launch(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "KVMESH_ENGINE_TORCH_THREADS": "1", **(env or {}), **ports()}
    return subprocess.Popen([sys.executable, "-m", "kvmesh", "up", "--run-dir", str(run_dir), "--exit-with-parent", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(launcher: subprocess.Popen) -> str:
    """Stop the launcher (SIGTERM: it stops its children) and return what it printed."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=30)
    return output or ""


def ready(run_dir: Path, names: list[str]) -> Status | None:
    current = status(run_dir)
    if current.running and [c.name for c in current.children] == names and all(c.ready for c in current.children):
        return current
    return None


@contextlib.contextmanager
def running_cluster(run_dir: Path, names: list[str], *args: str, timeout: float = 120, env: dict | None = None):
    """`kvmesh up ARGS` until the block ends; one that is not up with NAMES in time fails the test with
    what the launcher printed and the end of each child's log."""
    launcher = launch(run_dir, *args, env=env)
    try:
        try:
            wait_for(lambda: ready(run_dir, names), timeout=timeout)
        except AssertionError:
            output = stop(launcher)
            logs = "".join(f"\n--- {log.name}:\n{tail(log)}" for log in sorted((run_dir / "logs").glob("*.log")))
            raise AssertionError(f"kvmesh up {' '.join(args)} was not up with {names} within {timeout:.0f}s; "
                                 f"it printed:\n{output}{logs}") from None
        yield launcher, run_dir
    finally:
        stop(launcher)


COLOCATED = ["redis", "kvmeta", "predictor", "scheduler", "engine-c0", "admission"]


@pytest.fixture(scope="class")
def colocated(tmp_path_factory: pytest.TempPathFactory):
    """The smallest whole cluster (one colocated engine), shared by the tests that leave it running."""
    with running_cluster(tmp_path_factory.mktemp("colocated") / "run", COLOCATED, "--colocated") as cluster:
        yield cluster


CONFIGURED = {"KVMESH_API_KEY": "sk-configured-key", "KVMESH_TOKEN": "configured-token"}


@pytest.fixture
def cluster(tmp_path: Path):
    """A colocated cluster of the test's own, for the tests that stop it; its secrets are configured,
    not generated, and the local tools (status, down) still reach it."""
    with running_cluster(tmp_path / "run", COLOCATED, "--colocated", env=CONFIGURED) as cluster:
        yield cluster


@pytest.fixture(scope="class")
def disaggregated(tmp_path_factory: pytest.TempPathFactory):
    """The default cluster: one prefill and one decode engine."""
    with running_cluster(tmp_path_factory.mktemp("up") / "run", SERVICES) as cluster:
        yield cluster


async def registered(run_dir: Path) -> list[tuple[str, str, bool]]:
    token = (run_dir / "token").read_text().strip()
    kvmeta = next(c for c in status(run_dir).children if c.name == "kvmeta")
    async with KvmetaClient(kvmeta.url, token) as client:
        return sorted((w.info.id, w.info.role, bool(w.info.data_address)) for w in await client.workers())


class TestTheDefaultCluster:
    """One 1P1D cluster shared by its tests (class-scoped: it stops before the next cluster starts)."""

    def test_up_starts_the_1p1d_cluster_and_status_reports_it(self, disaggregated):
        launcher, run_dir = disaggregated
        current = status(run_dir)
        assert [c.name for c in current.children] == SERVICES
        assert all(http_ok(c.url + "/ready") for c in current.children[1:])
        for secret in ("token", "api_key"):  # generated, private
            assert (run_dir / secret).stat().st_mode & 0o077 == 0
        assert (run_dir / "api_key").read_text().startswith("sk-kvmesh-")
        assert kvmesh("status", "--run-dir", str(run_dir)).returncode == 0


    async def test_a_chat_question_gets_the_real_models_answer(self, disaggregated):
        """The README's quick start: the default model, SmolLM2-135M-Instruct, through its chat template."""
        _, run_dir = disaggregated
        admission = next(c for c in status(run_dir).children if c.name == "admission")
        key = (run_dir / "api_key").read_text().strip()
        async with openai.AsyncOpenAI(base_url=admission.url + "/v1", api_key=key, max_retries=0) as client:
            assert [m.id for m in (await client.models.list()).data] == [DEFAULT_MODEL]
            question = [{"role": "user", "content": "What is the capital of France?"}]
            answer = await client.chat.completions.create(model=DEFAULT_MODEL, messages=question, max_tokens=24,
                                                          temperature=0)
            assert "Paris" in answer.choices[0].message.content
            chunks = [c async for c in await client.chat.completions.create(
                model=DEFAULT_MODEL, messages=question, max_tokens=24, temperature=0, stream=True)]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
                answer.choices[0].message.content
        async with ServiceClient(next(c for c in status(run_dir).children if c.name == "engine-d0").url,
                                 token=(run_dir / "token").read_text().strip()) as engine:
            state = await engine.call("GET", "/v1/state", into=dict)
            assert state["free_blocks"] == state["total_blocks"]

    async def test_the_engines_register_with_their_roles_and_data_addresses(self, disaggregated):
        _, run_dir = disaggregated
        assert await registered(run_dir) == [("engine-d0", "decode", True), ("engine-p0", "prefill", True)]


    async def test_scale_adds_and_removes_an_engine_while_the_cluster_runs(self, disaggregated):
        _, run_dir = disaggregated
        assert kvmesh("scale", "--run-dir", str(run_dir), "--prefill", "2").returncode == 0
        wait_for(lambda: ready(run_dir, SERVICES[:5] + ["engine-d0", "admission", "engine-p1"]), timeout=90)
        assert ("engine-p1", "prefill", True) in await registered(run_dir)
        assert kvmesh("scale", "--run-dir", str(run_dir), "--prefill", "1").returncode == 0
        wait_for(lambda: ready(run_dir, SERVICES), timeout=60)
        deadline = time.monotonic() + 10
        while ("engine-p1", "prefill", True) in await registered(run_dir):  # it deregisters as it stops
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        refused = kvmesh("scale", "--run-dir", str(run_dir), "--prefill", "0")
        assert refused.returncode == 2 and "both, or neither" in refused.stdout


class TestTheColocatedCluster:
    """One colocated cluster shared by the tests that leave it running."""

    async def test_the_colocated_engine_serves(self, colocated):
        launcher, run_dir = colocated
        token = (run_dir / "token").read_text().strip()
        engine = next(c for c in status(run_dir).children if c.name == "engine-c0")
        async with ServiceClient(engine.url, token=token) as client:
            frames = [f async for f in client.frames("/v1/generate", {"prompt": "hello", "max_tokens": 4,
                                                                      "ignore_eos": True}, Frame)]
        assert frames[-1].finish_reason == "length" and frames[-1].usage.completion_tokens == 4


    def test_a_crashed_service_is_restarted(self, colocated):
        launcher, run_dir = colocated
        old = next(c for c in status(run_dir).children if c.name == "kvmeta")
        os.kill(old.pid, signal.SIGKILL)
        new = wait_for(lambda: next((c for c in status(run_dir).children if c.name == "kvmeta" and c.pid != old.pid
                                     and c.ready), None))
        assert new.restarts == 1 and http_ok(new.url + "/ready")


    async def test_a_request_made_while_admission_restarts_waits_for_it(self, colocated):
        """The launcher holds each stateless service's listening socket across restarts: a request sent
        while admission is dead (killed, its successor still starting) waits in the kernel's backlog and
        the new process answers it, where a closed port would refuse it."""
        launcher, run_dir = colocated
        old = next(c for c in status(run_dir).children if c.name == "admission")
        key = (run_dir / "api_key").read_text().strip()
        os.kill(old.pid, signal.SIGKILL)
        wait_for(lambda: _dead(old.pid), timeout=10)
        async with openai.AsyncOpenAI(base_url=old.url + "/v1", api_key=key, max_retries=0, timeout=60) as client:
            answer = await client.completions.create(model=DEFAULT_MODEL, prompt="are you back", max_tokens=2)
        assert answer.usage.completion_tokens == 2
        assert next(c for c in status(run_dir).children if c.name == "admission").pid != old.pid

    async def test_swap_replaces_policies_and_a_restarted_service_keeps_them(self, colocated, tmp_path: Path):
        """`kvmesh swap`: admission's predictor becomes a third-party service, the engines' preemption order
        another; each survives a crash and restart of the service it changed; bad swaps change nothing."""
        launcher, run_dir = colocated
        token = (run_dir / "token").read_text().strip()
        children = {c.name: c for c in status(run_dir).children}
        replacement = ratio_predictor(tmp_path, token)
        replacement.wait_ready()
        swap = lambda *args: kvmesh("swap", *args, "--run-dir", str(run_dir))  # noqa: E731
        try:
            done = swap("predictor", replacement.url)
            assert done.returncode == 0 and f"admission now calls predictor at {replacement.url}" in done.stdout
            assert swap("engines", "preemption_order=srtf").returncode == 0
            refused = [swap("scheduler", "off"), swap("engines", "preemption_order"), swap("engines", "nonsense=x"),
                       swap("predictor", "http://127.0.0.1:9")]
            assert [r.returncode for r in refused] == [2, 2, 2, 2] and "is not a ready service" in refused[-1].stdout

            for name in ("admission", "engine-c0"):
                os.kill(children[name].pid, signal.SIGKILL)
            wait_for(lambda: all(c.ready and c.pid != children[c.name].pid for c in status(run_dir).children
                                 if c.name in ("admission", "engine-c0")), timeout=90)
            async with ServiceClient(children["admission"].url, token=token) as admission:
                assert (await admission.call("GET", "/v1/upstreams", into=dict))["predictor_url"] == replacement.url
            async with ServiceClient(children["engine-c0"].url, token=token) as engine:
                assert (await engine.call("GET", "/v1/state", into=dict))["policies"]["preemption_order"] == "srtf"
            key = (run_dir / "api_key").read_text().strip()
            async with openai.AsyncOpenAI(base_url=children["admission"].url + "/v1", api_key=key, max_retries=0) as client:
                await client.completions.create(model=DEFAULT_MODEL, prompt="who predicts me", max_tokens=2)
            assert counter(replacement.url, "ratio_predictor_predictions_total") == 1
        finally:
            assert swap("predictor", "builtin").returncode == 0
            assert swap("engines", "preemption_order=latest_arrival_first").returncode == 0
            replacement.stop()


def _dead(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet: it runs no code either way."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_sigterm_stops_everything_cleanly_and_no_log_holds_a_secret(cluster):
    launcher, run_dir = cluster
    pids = [c.pid for c in status(run_dir).children]
    admission = next(c for c in status(run_dir).children if c.name == "admission")
    asked = openai.OpenAI(base_url=admission.url + "/v1", api_key=CONFIGURED["KVMESH_API_KEY"], max_retries=0)
    assert asked.completions.create(model=DEFAULT_MODEL, prompt="keep a secret", max_tokens=2).usage.completion_tokens == 2
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, output
    assert "API key: from KVMESH_API_KEY" in output and CONFIGURED["KVMESH_API_KEY"] not in output
    logs = "".join(log.read_text(errors="replace") for log in (run_dir / "logs").glob("*.log"))
    assert "effective config" in logs  # every service logged its settings, secrets masked
    assert not [secret for secret in CONFIGURED.values() if secret in logs]
    assert (run_dir / "api_key").read_text().strip() == CONFIGURED["KVMESH_API_KEY"]
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


def test_exit_with_parent_stops_the_cluster_when_its_starter_dies(tmp_path: Path):
    """A test or benchmark killed midway (a timeout's SIGKILL) leaves no cluster running behind it."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "KVMESH_ENGINE_TORCH_THREADS": "1", **ports()}
    up = [sys.executable, "-m", "kvmesh", "up", "--run-dir", str(run_dir), "--colocated", "--model", "tiny",
          "--exit-with-parent"]
    starter = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                f"subprocess.Popen({up!r}, stdout=subprocess.DEVNULL, start_new_session=True); "
                                "time.sleep(600)"], env=env)
    try:
        current = wait_for(lambda: ready(run_dir, COLOCATED), timeout=120)
        pids = [current.launcher_pid, *(c.pid for c in current.children)]
    finally:
        starter.kill()
        starter.wait()
    wait_for(lambda: all(_dead(pid) for pid in pids), timeout=30)
    assert not (run_dir / "state.json").exists()
