"""Cross-memory attach, the shm backend's way into private memory: a scatter list of more segments
than one call takes lands exactly, a process that is gone is a clear error, and a host whose Yama
policy forbids it refuses to register private memory, saying why (shared memory still registers)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvmesh.libs.rdma.backends import open_endpoint
from kvmesh.libs.rdma.shm import cma
from kvmesh.libs.rdma.shm.shared import shared_buffer
from kvmesh.libs.rdma.work import RegistrationError

from .conftest import TOKEN


def test_a_scatter_list_longer_than_iov_max_lands_every_segment():
    source = np.random.default_rng(1).integers(0, 256, 3000 * 16, dtype=np.uint8)
    target = np.zeros_like(source)
    order = np.random.default_rng(2).permutation(3000)   # 3000 16-byte segments, shuffled: three calls
    lengths = np.full(3000, 16)
    cma.read(os.getpid(), memoryview(target), order * 16, source.ctypes.data + np.arange(3000) * 16, lengths)
    assert np.array_equal(target.reshape(3000, 16)[order], source.reshape(3000, 16))


def test_a_process_that_is_gone_is_a_clear_error():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    target = np.zeros(64, dtype=np.uint8)
    with pytest.raises(cma.CmaError, match=f"process {gone.pid}"):
        cma.read(gone.pid, memoryview(target), np.array([0]), np.array([4096]), np.array([64]))


@pytest.mark.parametrize("scope, refused", [("0", False), ("1", False), ("2", True), ("3", True)])
async def test_registering_private_memory_follows_the_hosts_ptrace_policy(tmp_path, monkeypatch, scope, refused):
    policy = tmp_path / "ptrace_scope"
    policy.write_text(scope + "\n")
    monkeypatch.setattr(cma, "PTRACE_SCOPE", policy)
    monkeypatch.setattr(cma, "allow_peers", lambda: None)   # what it would ask of the real kernel
    endpoint = open_endpoint("shm", TOKEN)
    private = np.zeros(4096, dtype=np.uint8)
    if refused:
        with pytest.raises(RegistrationError, match=f"ptrace_scope is {scope}"):
            endpoint.register(private)
        assert not endpoint.regions
    else:
        endpoint.register(private)
    endpoint.register(shared_buffer(4096))   # a shared file is mapped, whatever the policy
    reason = cma.unavailable_reason()
    assert ("ptrace_scope" in reason) if refused else reason is None
