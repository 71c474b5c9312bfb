"""Fixtures for the data plane: every conformance test runs once per backend, skipped with the
reason where the backend cannot run here (verbs without an RDMA device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvmesh.libs.rdma.backends import BACKENDS, open_endpoint, unavailable_reason
from kvmesh.libs.rdma.memory import RemoteRegion
from kvmesh.libs.rdma.shm.shared import shared_buffer

TOKEN = "test-cluster-token"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=list(BACKENDS))
def backend(request) -> str:
    reason = unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} backend unavailable here: {reason}")
    return request.param


@pytest.fixture
async def endpoints(backend):
    """Two started endpoints of the backend: (owner of the memory, reader)."""
    made = [open_endpoint(backend, TOKEN), open_endpoint(backend, TOKEN)]
    for endpoint in made:
        await endpoint.start()
    yield made
    for endpoint in made:
        await endpoint.close()


def private_buffer(nbytes: int) -> np.ndarray:
    return np.zeros(nbytes, dtype=np.uint8)


MEMORY = {"shared": shared_buffer, "private": private_buffer}


@pytest.fixture(params=list(MEMORY))
def memory(request) -> str:
    """Where registered buffers live: a shared file (the native engine's pools; shm maps it) or
    private memory (vLLM's KV cache; shm reads it by cross-memory attach)."""
    return request.param


@pytest.fixture
def buffer(memory):
    """Allocates the test's buffers in that memory."""
    return MEMORY[memory]


class PeerProcess:
    def __init__(self, backend: str, nbytes: int, seed: int, memory: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.rdma.peer", backend, TOKEN, str(nbytes), str(seed),
                                      memory],
                                     stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process exited with {self.proc.wait(5)}")
        info = json.loads(line)
        self.address = info["address"]
        self.region = RemoteRegion(*info["region"])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def peer_process(memory):
    """Starts peers whose pool is in the test's kind of memory."""
    started: list[PeerProcess] = []

    def start(backend: str, nbytes: int, seed: int = 0) -> PeerProcess:
        started.append(PeerProcess(backend, nbytes, seed, memory))
        return started[-1]

    yield start
    for peer in started:
        if peer.proc.poll() is None:
            peer.kill()
