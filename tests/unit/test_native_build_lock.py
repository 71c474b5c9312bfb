"""libs/native's build lock: a torch baton left by a build killed midway no longer makes every later
load wait for ever, and the lock itself goes with a holder that is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.libs.native import build_lock

HOLD = """
import sys, time
from pathlib import Path
from kvmesh.libs.native import build_lock
with build_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "held").touch()
    time.sleep(600)
"""


def test_a_baton_left_by_a_killed_build_is_removed_under_the_lock(tmp_path):
    (tmp_path / "lock").touch()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_killed_holder_leaves_the_lock_free(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "held").exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        (tmp_path / "lock").touch()  # as torch's baton would be, mid-build
    finally:
        holder.kill()
        holder.wait()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_build_runs_the_virtualenvs_tools_first_and_leaves_path_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with build_lock(tmp_path):
        assert os.environ["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert os.environ["PATH"] == "/usr/bin:/bin"
