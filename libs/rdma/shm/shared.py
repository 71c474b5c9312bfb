"""Memory a peer process can map: files in /dev/shm, and finding the file behind a mapping.

The shm backend registers only memory that lives in a shared file mapping (MAP_SHARED), because the
peer reaches it by mapping the same file. `shared_buffer`/`shared_tensor` allocate such memory; a
pool made with `torch.from_file(path, shared=True)` (the engine's file-backed tiers) qualifies as is.

A file in /dev/shm is memory until someone removes it, and a process killed with SIGKILL removes
nothing: each file is named after its owner (`owned_path`: pid namespace and pid), and the first
kvmesh file a process makes removes those whose owner, in its own pid namespace, is gone.
"""

from __future__ import annotations

import os
import re
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cma import pid_namespace

SHM_DIR = Path("/dev/shm")
_swept = False  # this process has removed the orphans it found


@dataclass(frozen=True)
class FileSpan:
    path: str
    offset: int  # of the region's first byte in the file


def owned_path(*names: str) -> Path:
    """A /dev/shm path that names this process as its owner, so that it is removed once the owner is
    gone even if nothing else removes it."""
    global _swept
    if not _swept:
        _swept = True
        sweep_orphans()
    return SHM_DIR / "-".join(("kvmesh", _namespace_tag(), str(os.getpid()), *names))


def sweep_orphans() -> list[Path]:
    """Remove the files `owned_path` named for processes of this pid namespace that no longer run."""
    removed, tag = [], _namespace_tag()
    pattern = re.compile(rf"kvmesh-{tag}-(\d+)-")
    for path in SHM_DIR.glob(f"kvmesh-{tag}-*"):
        owner = pattern.match(path.name)
        if owner is not None and not _running(int(owner.group(1))):
            _unlink(path)
            removed.append(path)
    return removed


def shared_buffer(nbytes: int) -> np.ndarray:
    """A zeroed byte array in a fresh /dev/shm file, removed when the array (and its views) are gone."""
    if nbytes <= 0:
        raise ValueError(f"shared_buffer: nbytes must be positive, got {nbytes}")
    path = owned_path(uuid.uuid4().hex[:12])
    with open(path, "xb") as file:
        file.truncate(nbytes)
    array = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
    weakref.finalize(array, _unlink, path)
    return array


def shared_tensor(shape: tuple[int, ...], dtype):
    """A zeroed torch tensor in shared memory (the layout of a KV pool that a peer maps)."""
    import torch

    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(shared_buffer(nbytes)).view(dtype).view(shape)


def file_span(addr: int, length: int) -> FileSpan | None:
    """The shared file mapping that holds [addr, addr+length) in this process, if there is one."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not start <= addr < end:
                continue
            path = fields[5].strip() if len(fields) == 6 else ""
            if addr + length > end or fields[1][3] != "s" or not path.startswith("/") or path.endswith("(deleted)"):
                return None
            return FileSpan(path, int(fields[2], 16) + addr - start)
    return None


def _namespace_tag() -> str:
    """The pid namespace's inode number, for a file name: pids mean one process only within it."""
    return pid_namespace().strip("pid:[]")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
