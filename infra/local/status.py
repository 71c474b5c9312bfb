"""`kvmesh status` and `kvmesh down`: what the local cluster in a run directory is doing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from .processes import is_ready
from .state import pid_alive, read_state


class ChildStatus(msgspec.Struct, kw_only=True):
    name: str
    pid: int | None
    url: str
    running: bool
    ready: bool
    restarts: int
    log: str


class Status(msgspec.Struct, kw_only=True):
    running: bool
    launcher_pid: int | None = None
    children: list[ChildStatus] = []


def status(run_dir: Path) -> Status:
    state = read_state(run_dir)
    if state is None or not pid_alive(state.launcher_pid):
        return Status(running=False)
    children = []
    for child in state.children:
        running = pid_alive(child.pid)
        ready = running and is_ready(child.url)
        children.append(ChildStatus(name=child.name, pid=child.pid, url=child.url, running=running, ready=ready,
                                    restarts=child.restarts, log=child.log))
    return Status(running=True, launcher_pid=state.launcher_pid, children=children)


def print_status(run_dir: Path, as_json: bool) -> int:
    current = status(run_dir)
    if as_json:
        print(msgspec.json.encode(current).decode())
    elif not current.running:
        Console().print(f"no kvmesh cluster runs from {run_dir}")
    else:
        table = Table(title=f"kvmesh (launcher pid {current.launcher_pid})")
        for column in ("service", "endpoint", "pid", "state", "restarts"):
            table.add_column(column)
        for c in current.children:
            state = "ready" if c.ready else ("starting" if c.running else "down")
            table.add_row(c.name, c.url, str(c.pid), state, str(c.restarts))
        Console().print(table)
    return 0 if current.running and all(c.ready for c in current.children) else 1


def down(run_dir: Path, timeout: float = 30.0) -> int:
    state = read_state(run_dir)
    if state is None or not pid_alive(state.launcher_pid):
        print(f"no kvmesh cluster runs from {run_dir}")
        return 0
    os.kill(state.launcher_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(state.launcher_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(state.launcher_pid):
        print(f"launcher pid {state.launcher_pid} did not stop within {timeout:.0f}s")
        return 1
    print("kvmesh: stopped")
    return 0
