"""Files in /dev/shm are memory: a shared buffer's file goes with its array, and the files of a process
killed with SIGKILL (which removes nothing) go the next time a kvmesh process makes one."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys

from kvmesh.libs.rdma.shm import shared


def test_a_shared_buffer_file_names_its_owner_and_goes_with_the_array():
    array = shared.shared_buffer(4096)
    path = array.filename
    assert f"-{os.getpid()}-" in str(path) and os.path.exists(path)
    del array
    gc.collect()
    assert not os.path.exists(path)


def test_the_files_of_a_killed_process_go_with_the_next_process_first_file():
    def make(then: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "import os, signal\nfrom kvmesh.libs.rdma.shm.shared import "
                               f"shared_buffer\nbuffer = shared_buffer(1 << 20)\nprint(buffer.filename, flush=True)\n{then}"],
                              capture_output=True, text=True)

    killed = make("os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL
    orphan = killed.stdout.strip()
    assert os.path.exists(orphan)  # nothing removed it
    mine = shared.owned_path("test-live")
    mine.write_bytes(b"x")  # a file of a process that runs (this one)
    try:
        assert make("").returncode == 0
        assert not os.path.exists(orphan)
        assert mine.exists()
    finally:
        mine.unlink()
