"""A vLLM instance as a child process (bench/vllm_instance.py, run by .venv-vllm's python, which
scripts/setup-vllm.sh makes), for the vLLM backend's tests and `kvmesh bench vllm`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvmesh.infra.local.processes import ROOT
from kvmesh.infra.local.processes import VLLM_VENV_PYTHON as PYTHON


def vllm_missing() -> str | None:
    """None when .venv-vllm runs vLLM, else why not."""
    if not PYTHON.exists():
        return f"no {PYTHON.relative_to(ROOT)}: scripts/setup-vllm.sh could not install vLLM's CPU build here"
    error = _import_error("vllm")
    return None if error is None else f"vLLM does not import in .venv-vllm: {error[-300:]}"


def nixl_missing() -> str | None:
    """None when .venv-vllm has NIXL, which vLLM's NixlConnector loads, else why not."""
    error = _import_error("nixl._api")
    return None if error is None else f"no NIXL in .venv-vllm (make peers installs it): {error[-200:]}"


def _import_error(module: str) -> str | None:
    """What importing `module` in .venv-vllm writes to stderr when it fails; None when it imports."""
    found = subprocess.run([PYTHON, "-c", f"import {module}"], capture_output=True, text=True)
    return None if found.returncode == 0 else found.stderr


class VllmProcess:
    """One vLLM instance answering vllm_instance.py's commands; `ready()` waits for it to start."""

    def __init__(self, checkpoint: Path, role: str, cpu: str, log: Path, connector: str = "kvmesh",
                 data_port: int = 0, prefix_caching: bool = False, kv_bytes: int = 0, max_model_len: int = 2048,
                 max_num_seqs: int = 8, scheduler: dict | None = None, **settings: object):
        """`scheduler`: run KVMeshScheduler with this additional_config["kvmesh"]; `settings`: the connector's."""
        self.role, self.log, self.data_port = role, log, data_port
        self.process = subprocess.Popen(
            [PYTHON, "-m", "kvmesh.bench.vllm_instance", str(checkpoint), "--role", role, "--cpu", cpu,
             "--connector", connector, "--data-port", str(data_port), "--settings", json.dumps(settings),
             "--kv-bytes", str(kv_bytes), "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
             *(["--prefix-caching"] if prefix_caching else []),
             *(["--kvmesh-scheduler", json.dumps(scheduler)] if scheduler is not None else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=ROOT)

    def ready(self) -> None:
        self.answer()

    def send(self, op: str, **fields: object) -> None:
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()

    def ask(self, op: str, **fields: object) -> dict:
        self.send(op, **fields)
        return self.answer()

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None] | None = None) -> dict:
        return self.ask("generate", prompts=prompts, max_tokens=max_tokens, params=params or [None] * len(prompts))

    def answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        tail = self.log.read_text()[-2000:]
        raise RuntimeError(f"the vLLM {self.role} instance exited (code {self.process.wait()}):\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("exit")
            except OSError:
                pass
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
