"""vLLM instances for the vLLM backend's tests: real vLLM (its CPU build, from .venv-vllm, which
scripts/setup-vllm.sh makes), each in its own process on its own core, driven by instance.py.
Skipped, saying why, where that virtualenv could not be made."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.infra.local.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
INSTANCE = Path(__file__).with_name("instance.py")
START_TIMEOUT_S = 180


def vllm_missing() -> str | None:
    if not PYTHON.exists():
        return f"no {PYTHON.relative_to(ROOT)}: scripts/setup-vllm.sh could not install vLLM's CPU build here"
    found = subprocess.run([PYTHON, "-c", "import vllm"], capture_output=True, text=True)
    return None if found.returncode == 0 else f"vLLM does not import in .venv-vllm: {found.stderr[-300:]}"


class Instance:
    """One vLLM instance with the kvmesh connector in `role`, answering instance.py's commands."""

    def __init__(self, model: Path, role: str, cpu: int, log: Path, **settings: object):
        self.role = role
        self.data_port = free_port() if role == "kv_producer" else 0
        self.log = log
        self.process = subprocess.Popen(
            [PYTHON, INSTANCE, str(model), role, str(self.data_port), str(cpu), json.dumps(settings)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=ROOT)

    def ready(self) -> None:
        self._answer()

    def ask(self, op: str, **fields: object) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None] | None = None) -> dict:
        return self.ask("generate", prompts=prompts, max_tokens=max_tokens, params=params or [None] * len(prompts))

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.ask("exit")
            except RuntimeError:
                pass
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        tail = self.log.read_text()[-2000:]
        raise RuntimeError(f"the vLLM {self.role} instance exited (code {self.process.wait()}):\n{tail}")


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    from kvmesh.services.engine.models import save_preset_checkpoint

    return save_preset_checkpoint("tiny", tmp_path_factory.mktemp("vllm-tiny"), seed=0)


@pytest.fixture(scope="module")
def pair(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Instance, Instance]]:
    """A prefill (producer) and a decode (consumer) instance, one core each, started side by side."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    producer = Instance(vllm_model, "kv_producer", 0, logs / "producer.log", lease_s=3.0)
    consumer = Instance(vllm_model, "kv_consumer", 1 if _cores() > 1 else 0, logs / "consumer.log")
    try:
        producer.ready()
        consumer.ready()
        yield producer, consumer
    finally:
        producer.stop()
        consumer.stop()


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if sys.platform == "linux" else 1
