"""The run directory of a local cluster: its state file, token and logs; what `kvmesh status` reads."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import msgspec

DEFAULT_RUN_DIR = Path(os.environ.get("KVMESH_HOME", Path.home() / ".kvmesh")) / "run"


class ChildState(msgspec.Struct, kw_only=True):
    name: str
    pid: int | None
    url: str
    log: str
    restarts: int = 0


class ClusterState(msgspec.Struct, kw_only=True):
    launcher_pid: int
    started_at: float
    token_file: str
    children: list[ChildState]


def state_path(run_dir: Path) -> Path:
    return run_dir / "state.json"


def write_state(run_dir: Path, state: ClusterState) -> None:
    path = state_path(run_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    tmp.replace(path)


def read_state(run_dir: Path) -> ClusterState | None:
    try:
        return msgspec.json.decode(state_path(run_dir).read_bytes(), type=ClusterState)
    except (OSError, msgspec.DecodeError):
        return None


def pid_alive(pid: int | None) -> bool:
    """Whether the process runs; an exited one its parent has not reaped yet (a zombie) does not."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def cluster_token(run_dir: Path, configured: str | None) -> tuple[str, Path]:
    """The configured token, or the one this run directory already has, or a new one (mode 0600)."""
    return _secret(run_dir / "token", configured, secrets.token_urlsafe(24))


def api_key(run_dir: Path, configured: str | None) -> tuple[str, Path]:
    """The front door's API key: configured (KVMESH_API_KEY), kept from an earlier run, or new."""
    return _secret(run_dir / "api_key", configured, "sk-kvmesh-" + secrets.token_urlsafe(24))


def _secret(path: Path, configured: str | None, new: str) -> tuple[str, Path]:
    """The secret, kept in `path` (mode 0600) whatever its source: the local tools (status, swap,
    scale, the benches) read it there."""
    if not configured and path.exists():
        return path.read_text().strip(), path
    secret = configured or new
    path.touch(mode=0o600)
    path.write_text(secret + "\n")
    return secret, path
